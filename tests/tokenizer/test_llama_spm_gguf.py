"""Llama 2's SentencePiece GGUF tokenizer: the ids and text transformers gives for the same file.

The file is llama.cpp's `ggml-vocab-llama-spm.gguf` (Llama 2's 32,000 pieces, scores and no merges;
from llama-cpp-python's sdist, tests/llama_cpp_files.py), the expected outputs
(tests/fixtures/gguf_tokenizers/llama-spm.json, made by tests/tools/make_spm_tokenizer_fixtures.py)
transformers' `AutoTokenizer` with `gguf_file=` over the Gemma fixtures' corpus, llama.cpp's tokenizer
test texts and Llama's special tokens and [INST] prompts in text. llama.cpp's own vectors for the file
hold the ids of Llama 2's legacy tokenizer.json, which puts a "▁" before every run of text; transformers
(and so base) puts one before the text's first run only, and none before a text that starts with a
space: the vectors where the two part are exactly those that start with a space.
"""

from __future__ import annotations

import json

import pytest

from baselm.loader import tokenizer_from_header
from baselm.store.convert_gguf import gguf_tokenizer
from baselm.store.gguf import read_metadata
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import GGUF_TOKENIZER_FIXTURES
from tests.tokenizer.test_llama_cpp_vocabs import golden_cases

EXPECTED = json.loads((GGUF_TOKENIZER_FIXTURES / "llama-spm.json").read_text(encoding="utf-8"))
SOURCE = EXPECTED["source"]["file"]


@pytest.fixture(scope="module")
def metadata(llama_cpp_models) -> dict:
    return read_metadata(llama_cpp_models / SOURCE)[1]


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


def test_the_expected_outputs_are_for_this_file(llama_cpp_models):
    import hashlib

    assert hashlib.sha256((llama_cpp_models / SOURCE).read_bytes()).hexdigest() == EXPECTED["source"]["sha256"]
    assert len(EXPECTED["cases"]) >= 250


def test_llama_spm_gguf_encodes_as_transformers_does(tok):
    cases = EXPECTED["cases"]
    wrong = [c["text"] for c in cases if tok.encode(c["text"], add_special_tokens=False) != c["ids"]]
    assert wrong == [], f"{len(cases) - len(wrong)}/{len(cases)} pass"


def test_llama_spm_gguf_decodes_as_transformers_does(tok):
    cases = EXPECTED["cases"]
    assert [c["text"] for c in cases if tok.decode(c["ids"]) != c["decoded"]] == []
    skipping = [c for c in cases if "decoded_skip_special" in c]
    assert len(skipping) >= 5
    assert [c["text"] for c in skipping if tok.decode(c["ids"], True) != c["decoded_skip_special"]] == []


def test_llama_spm_gguf_adds_bos_as_transformers_does(tok):
    assert tok.add_bos_token and tok.bos_token_id == 1
    assert [c["text"] for c in EXPECTED["with_bos"] if tok.encode(c["text"]) != c["ids"]] == []


def test_the_first_run_alone_gets_a_space_mark_as_transformers_puts_it(tok):
    pieces = lambda text: [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]  # noqa: E731
    assert pieces("hello") == ["▁hello"]
    assert pieces(" hello") == ["▁hello"]  # llama.cpp: "▁", "▁hello"
    assert pieces("<s>hello") == ["<s>", "hello"]  # llama.cpp: "<s>", "▁hello"
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_a_vocabulary_stored_in_a_base_file_encodes_the_same(tok, metadata):
    stored = tokenizer_from_header(gguf_tokenizer(metadata))  # what `base pull` keeps of the GGUF
    cases = EXPECTED["cases"]
    assert [c["text"] for c in cases if stored.encode(c["text"], add_special_tokens=False) != c["ids"]] == []
    as_hf = Tokenizer.from_hf_files(*tok.to_hf_files())
    assert [c["text"] for c in cases if as_hf.encode(c["text"], add_special_tokens=False) != c["ids"]] == []


def test_llama_cpp_vectors_differ_only_on_texts_that_start_with_a_space(tok, llama_cpp_models):
    golden = golden_cases(llama_cpp_models, "llama-spm")
    differ = [text for text, ids in golden if tok.encode(text, add_special_tokens=False) != ids]
    assert (len(golden), len(differ)) == (46, 15)
    assert all(text.startswith(" ") for text in differ)
