"""`tokenizer.ggml.pre` names and vocabulary kinds real GGUFs carry encode as transformers does.

One byte-level vocabulary (bpe-gpt2.gguf) under each name transformers gives a split of its own,
and under the names it reads with GPT-2's split as base does; and one SentencePiece vocabulary
(spm.gguf) as a Phi-3 file. The expected ids (tests/fixtures/gguf_tokenizers/pre-tokenizers.json, made
by tests/tools/make_pre_tokenizer_fixtures.py) are transformers' for the same files, over 243
texts. Where transformers' GGUF reader departs from the model's own byte-level split (smollm, refact,
command-r, starcoder, deepseek-llm, deepseek-coder, falcon), base follows the model: llama.cpp's
vectors check those (test_llama_cpp_vocabs.py). SentencePiece files follow transformers
(test_llama_spm_gguf.py).
Names llama.cpp knows and base does not read are refused by name.
"""

from __future__ import annotations

import json

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import GGUF_TOKENIZER_FIXTURES, TOKENIZER_FIXTURES

EXPECTED = json.loads((GGUF_TOKENIZER_FIXTURES / "pre-tokenizers.json").read_text(encoding="utf-8"))
# Real files carry these; base does not read their splits yet (no reference to check one against).
REFUSED = ["deepseek-v3", "superbpe", "glm4", "kimi-k2", "seed-coder", "hunyuan", "chatglm-bpe", "bailingmoe"]


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
    with pytest.raises(TokenizerError, match=f"pre-tokenizer '{name}' is not supported"):
        Tokenizer.from_gguf_metadata(metadata)


def test_phi3_sentencepiece_encodes_as_transformers_does():
    metadata = {**read_metadata(TOKENIZER_FIXTURES / "spm.gguf")[1], "general.architecture": "phi3"}
    tok = Tokenizer.from_gguf_metadata(metadata)
    texts = EXPECTED["texts"]
    wrong = [t for t, ids in zip(texts, EXPECTED["phi3"]) if tok.encode(t, add_special_tokens=False) != ids]
    assert wrong == [], f"{len(texts) - len(wrong)}/{len(texts)} pass"
