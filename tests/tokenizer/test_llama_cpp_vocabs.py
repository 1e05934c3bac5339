"""llama.cpp's own tokenizer test vectors: every vocabulary it ships encodes to its golden ids.

Each `ggml-vocab-NAME.gguf` in llama.cpp's `models/` holds only tokenizer metadata; beside it
`.inp` holds texts (split by `__ggml_vocab_test__` lines) and `.out` the ids the model's own
HF tokenizer gives each (no BOS/EOS added). The files come from llama-cpp-python's sdist. Llama 2's
SentencePiece file is read as transformers reads it instead (test_llama_spm_gguf.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.tokenizer import Tokenizer

WITH_VECTORS = [
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]
WITHOUT_VECTORS = ["aquila", "baichuan", "gpt-neox"]  # built, nothing to compare against
# Its vectors hold Llama 2's legacy tokenizer's ids; base reads the file as transformers does, which
# departs from them on texts that start with a space (test_llama_spm_gguf.py checks both).
READ_AS_TRANSFORMERS = ["llama-spm"]
REFUSED = {"nomic-bert-moe": "tokenizer model 't5' is not supported"}  # a SentencePiece Unigram
_SEPARATOR = "\n__ggml_vocab_test__\n"


def vocabulary(models: Path, name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(models / f"ggml-vocab-{name}.gguf")[1])


def golden_cases(models: Path, name: str) -> list[tuple[str, list[int]]]:
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    lines = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    if texts[-1] == "":  # most files end each case with a separator, some only separate them
        texts.pop()
    assert len(lines) >= len(texts)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


@dataclass
class Vocabulary:
    name: str
    tokenizer: Tokenizer
    cases: list[tuple[str, list[int]]]


@pytest.fixture(scope="module", params=WITH_VECTORS)
def vocab(request, llama_cpp_models) -> Vocabulary:
    """One vocabulary with golden outputs; module scope, so pytest builds each once for all its tests."""
    name = request.param
    return Vocabulary(name, vocabulary(llama_cpp_models, name), golden_cases(llama_cpp_models, name))


def test_vocabulary_encodes_llama_cpp_golden_ids(vocab):
    cases = vocab.cases
    mismatches = [(t, want) for t, want in cases if vocab.tokenizer.encode(t, add_special_tokens=False) != want]
    assert len(cases) >= 40
    assert mismatches == [], f"{len(cases) - len(mismatches)}/{len(cases)} pass"


def test_vocabulary_stored_as_hf_files_still_encodes_the_golden_ids(vocab):
    # What a .base file keeps of a GGUF's tokenizer: tokenizer.json and tokenizer_config.
    tok = Tokenizer.from_hf_files(*vocab.tokenizer.to_hf_files())
    assert [text for text, want in vocab.cases if tok.encode(text, add_special_tokens=False) != want] == []


def test_vocabulary_decodes_golden_ids_back_to_the_text(vocab):
    if vocab.name == "bert-bge":
        pytest.skip("a WordPiece vocabulary lower-cases and splits on punctuation: decode is not the text")
    assert [text for text, ids in vocab.cases if vocab.tokenizer.decode(ids) != text] == []


@pytest.mark.parametrize("name", WITHOUT_VECTORS)
def test_vocabulary_without_vectors_builds_and_round_trips_text(llama_cpp_models, name):
    tok = vocabulary(llama_cpp_models, name)
    text = "Hello world, 2024!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_vocabulary_is_refused_by_name(llama_cpp_models, name):
    with pytest.raises(TokenizerError, match=REFUSED[name]):
        vocabulary(llama_cpp_models, name)


def test_every_shipped_vocabulary_is_checked(llama_cpp_models):
    shipped = {p.name[len("ggml-vocab-") : -len(".gguf")] for p in llama_cpp_models.glob("ggml-vocab-*.gguf")}
    assert shipped == {*WITH_VECTORS, *WITHOUT_VECTORS, *READ_AS_TRANSFORMERS, *REFUSED}


def test_named_chat_templates_of_a_gguf_are_kept_by_name(llama_cpp_models):
    # Command R's vocabulary carries `tokenizer.chat_template.tool_use` and `.rag` beside its default.
    tok = vocabulary(llama_cpp_models, "command-r")
    assert set(tok.to_hf_files()[1]["chat_template"]) == {"default", "tool_use", "rag"}
    ask = [{"role": "user", "content": "hi"}]
    tool = {"name": "search", "description": "Looks it up.", "parameter_definitions": {}}
    assert "## Available Tools" not in tok.apply_chat_template(ask)
    assert "## Available Tools" in tok.apply_chat_template(ask, tools=[tool])
