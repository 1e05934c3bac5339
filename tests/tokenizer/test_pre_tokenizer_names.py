"""`tokenizer.ggml.pre` names and vocabulary kinds real GGUFs carry encode as transformers does.

One byte-level vocabulary (bpe-gpt2.gguf) under each name transformers gives a split of its own,
and under the names it reads with GPT-2's split as base does; and one SentencePiece vocabulary
(spm.gguf) as a Phi-3 file. The expected ids (tests/fixtures/gguf_tokenizers/pre-tokenizers.json, made
by tests/tools/make_pre_tokenizer_fixtures.py) are transformers' for the same files, over 243
texts. Where transformers' GGUF reader departs from the model's own byte-level split (smollm, refact,
command-r, starcoder, deepseek-llm, deepseek-coder, falcon), base follows the model: llama.cpp's
vectors check those (test_llama_cpp_vocabs.py). SentencePiece files follow transformers
(test_llama_spm_gguf.py).
Names llama.cpp knows and base does not read are refused by name, with the models that carry them
and why (gguf_splits.UNREAD).
"""

from __future__ import annotations

import json

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.gguf_splits import SPLITS, UNREAD
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import GGUF_TOKENIZER_FIXTURES, TOKENIZER_FIXTURES

EXPECTED = json.loads((GGUF_TOKENIZER_FIXTURES / "pre-tokenizers.json").read_text(encoding="utf-8"))
# The `pre` names real byte-level GGUFs of these families carry (llama.cpp's converter names each
# model's tokenizer by the hash of its output: convert_hf_to_gguf's get_vocab_base_pre). Llama 2,
# Mistral 7B and Phi-3 files are SentencePiece ('llama') and carry none (test_llama_spm_gguf.py and
# the Phi-3 test below).
FAMILIES = {
    "refact": "Granite 3.x",
    "dbrx": "Granite 4.0, OLMo 2 and Phi-4 (cl100k-based tokenizers)",
    "smaug-bpe": "SmolLM3",
    "smollm": "SmolLM, SmolLM2",
    "llama-bpe": "Llama 3.x, DeepSeek R1 distills of Llama",
    "tekken": "Mistral Nemo, Small 3.x, Devstral",
    "pixtral": "Pixtral",
    "qwen2": "Qwen 1.5, 2, 2.5, 3",
    "qwen35": "Qwen 3.5",
    "deepseek-r1-qwen": "DeepSeek R1 distills of Qwen",
    "deepseek-llm": "DeepSeek LLM",
    "deepseek-coder": "DeepSeek Coder",
    "deepseek-v3": "DeepSeek V3, R1, V3.1, V3.2",
    "command-r": "Command R, R+",
    "gpt-4o": "Phi-4 mini",
}
# The splits llama.cpp's vocabularies with test vectors check (test_llama_cpp_vocabs.py), by their `pre`.
CHECKED_BY_VECTORS = ["refact", "command-r", "deepseek-llm", "deepseek-coder", "starcoder", "llama-bpe", "qwen2"]
REFUSED = sorted(UNREAD)


def expected_ids(name: str) -> list[list[int]]:
    ids = EXPECTED["ids"][name]
    return EXPECTED["ids"][ids] if isinstance(ids, str) else ids


@pytest.mark.parametrize("name", list(EXPECTED["ids"]))
def test_pre_tokenizer_name_encodes_as_transformers_does(name):
    metadata = {**read_metadata(TOKENIZER_FIXTURES / EXPECTED["source"])[1], "tokenizer.ggml.pre": name}
    tok = Tokenizer.from_gguf_metadata(metadata)
    texts, want = EXPECTED["texts"], expected_ids(name)
    wrong = [t for t, ids in zip(texts, want) if tok.encode(t, add_special_tokens=False) != ids]
    assert wrong == [], f"{len(texts) - len(wrong)}/{len(texts)} pass"


@pytest.mark.parametrize("name", REFUSED)
def test_pre_tokenizer_base_does_not_read_is_refused_by_name(name):
    metadata = {**read_metadata(TOKENIZER_FIXTURES / EXPECTED["source"])[1], "tokenizer.ggml.pre": name}
    with pytest.raises(TokenizerError, match=f"pre-tokenizer '{name}' .*is not supported") as caught:
        Tokenizer.from_gguf_metadata(metadata)
    assert f"({UNREAD[name]})" in str(caught.value)  # the models that carry it


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_name_real_files_carry_is_checked_against_a_reference_or_refused_with_the_reason(name):
    if name in UNREAD:
        metadata = {**read_metadata(TOKENIZER_FIXTURES / EXPECTED["source"])[1], "tokenizer.ggml.pre": name}
        with pytest.raises(TokenizerError, match="no reference tokenization") as caught:
            Tokenizer.from_gguf_metadata(metadata)
        assert UNREAD[name] in str(caught.value)
    else:
        checked = [SPLITS[n] for n in CHECKED_BY_VECTORS]
        assert name in EXPECTED["ids"] or SPLITS[name] in checked, FAMILIES[name]


def test_phi3_sentencepiece_encodes_as_transformers_does():
    metadata = {**read_metadata(TOKENIZER_FIXTURES / "spm.gguf")[1], "general.architecture": "phi3"}
    tok = Tokenizer.from_gguf_metadata(metadata)
    texts = EXPECTED["texts"]
    wrong = [t for t, ids in zip(texts, EXPECTED["phi3"]) if tok.encode(t, add_special_tokens=False) != ids]
    assert wrong == [], f"{len(texts) - len(wrong)}/{len(texts)} pass"
