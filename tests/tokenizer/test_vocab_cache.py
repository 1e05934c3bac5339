"""The merges base derives for a GGUF vocabulary whose file has none (Gemma's) are derived once and
read back after (baselm/tokenizer/vocab_cache.py): a second build reads the entry, a changed vocabulary
gets its own, a damaged one is derived again; the loader keeps its entries under base's home."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from baselm.loader import tokenizer_from_header
from baselm.store.convert_gguf import gguf_tokenizer
from baselm.store.gguf import read_metadata
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.tokenizer.vocab_cache import vocabulary_key
from tests.paths import GGUF_TOKENIZER_FIXTURES, TOKENIZER_FIXTURES

GEMMA = read_metadata(GGUF_TOKENIZER_FIXTURES / "gemma3-small.gguf")[1]
EXPECTED = json.loads((GGUF_TOKENIZER_FIXTURES / "gemma3-small.json").read_text(encoding="utf-8"))["cases"]
SPM = read_metadata(TOKENIZER_FIXTURES / "spm.gguf")[1]  # scores, no merges: derived from the scores
NUM_MERGES = 6683  # what the small Gemma vocabulary's 5096 tokens give


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _wrong(tok: Tokenizer) -> list[str]:
    return [c["text"] for c in EXPECTED if tok.encode(c["text"], add_special_tokens=False) != c["ids"]]


def test_derived_merges_are_kept_and_the_second_build_reads_them(tmp_path):
    first = Tokenizer.from_gguf_metadata(GEMMA, tmp_path)
    entry = tmp_path / f"{vocabulary_key(GEMMA)}.npy"
    assert _entries(tmp_path) == [entry.name]
    pairs = np.load(entry)
    assert pairs.dtype == np.int32 and pairs.shape[1] == 2 and len(pairs) == NUM_MERGES
    np.save(entry, pairs[:0])  # no merges: a mark only the entry carries
    unmerged = Tokenizer.from_gguf_metadata(GEMMA, tmp_path)
    assert len(unmerged.encode("the cat", add_special_tokens=False)) == 7  # one piece per character
    assert len(first.encode("the cat", add_special_tokens=False)) == 3  # "the", "▁c", "at" in the small vocabulary


def test_merges_read_back_encode_as_those_derived(tmp_path):
    assert _wrong(Tokenizer.from_gguf_metadata(GEMMA, tmp_path)) == []
    assert _wrong(Tokenizer.from_gguf_metadata(GEMMA, tmp_path)) == []
    spm_texts = ["hello world", " leading", "<s>after", "naïve café 2024"]
    fresh = [Tokenizer.from_gguf_metadata(SPM).encode(t) for t in spm_texts]
    Tokenizer.from_gguf_metadata(SPM, tmp_path)
    assert [Tokenizer.from_gguf_metadata(SPM, tmp_path).encode(t) for t in spm_texts] == fresh
    assert len(_entries(tmp_path)) == 2


def test_a_changed_vocabulary_gets_an_entry_of_its_own(tmp_path):
    Tokenizer.from_gguf_metadata(GEMMA, tmp_path)
    tokens = list(GEMMA["tokenizer.ggml.tokens"])
    i = tokens.index("▁the")
    tokens[i] = "▁thé"
    changed = Tokenizer.from_gguf_metadata({**GEMMA, "tokenizer.ggml.tokens": tokens}, tmp_path)
    assert len(_entries(tmp_path)) == 2
    assert i not in changed.encode(" the", add_special_tokens=False)
    assert i in Tokenizer.from_gguf_metadata(GEMMA, tmp_path).encode(" the", add_special_tokens=False)


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"\x93NUMPY garbage",
        np.arange(6, dtype=np.int32),  # not (n, 2)
        np.array([[0, 1], [2, 10**6]], dtype=np.int32),  # an id past the vocabulary
        np.zeros((2, 2), dtype=np.float32),
    ],
)
def test_a_damaged_entry_is_derived_again_and_rewritten(tmp_path, damage):
    entry = tmp_path / f"{vocabulary_key(GEMMA)}.npy"
    if isinstance(damage, bytes):
        entry.write_bytes(damage)
    else:
        np.save(entry, damage)
    assert _wrong(Tokenizer.from_gguf_metadata(GEMMA, tmp_path)) == []
    assert _entries(tmp_path) == [entry.name]  # rewritten in place, no temporary file left
    assert np.load(entry).shape[1] == 2 and len(np.load(entry)) == NUM_MERGES


def test_vocabularies_whose_file_holds_merges_or_that_are_not_sentencepiece_keep_nothing(tmp_path):
    Tokenizer.from_gguf_metadata(read_metadata(TOKENIZER_FIXTURES / "bpe-gpt2.gguf")[1], tmp_path)
    Tokenizer.from_gguf_metadata({**GEMMA, "tokenizer.ggml.merges": ["▁ t", "h e"]}, tmp_path)
    assert _entries(tmp_path) == []


def test_a_loaded_gguf_keeps_its_merges_under_base_home(tmp_path, monkeypatch):
    monkeypatch.setenv("BASE_HOME", str(tmp_path))
    tok = tokenizer_from_header(gguf_tokenizer(GEMMA))  # as a `.base` pulled from the GGUF loads it
    assert _entries(tmp_path / "tokenizers") == [f"{vocabulary_key(GEMMA)}.npy"]
    assert _wrong(tok) == []
