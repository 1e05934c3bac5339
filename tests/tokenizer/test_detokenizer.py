"""StreamingDetokenizer: its deltas add up to decode and never split a character."""

from __future__ import annotations

import random

import pytest

from baselm.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.conftest import CORPUS, load


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.finish()]


def id_sequences(tok: Tokenizer, seed: int) -> list[list[int]]:
    """The corpus encoded, random id sequences, and random runs rich in <0xNN> byte tokens."""
    rng = random.Random(seed)
    seqs = [tok.encode(text) for text in CORPUS]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    byte_ids = sorted(tok.byte_fallback_ids)
    if byte_ids:
        seqs += [
            [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(30)]
            for _ in range(150)
        ]
    return seqs


@pytest.mark.parametrize("tokenizer", ["bpe", "spm", "spm.gguf", "smollm2"], indirect=True)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_detokenizer_deltas_add_up_to_decode(tokenizer, skip_special_tokens):
    for ids in id_sequences(tokenizer, seed=int(skip_special_tokens)):
        deltas = stream(tokenizer, ids, skip_special_tokens)
        # Every delta is the full decode's text at its place: a U+FFFD in a delta is one decode has there.
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_detokenizer_holds_byte_fallback_runs_until_the_character_completes():
    tok = load("spm")
    ids = tok.encode("a😀b")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "b"]
    assert stream(tok, ids) == ["<s>", " a", "", "", "", "", "😀b", ""]
    assert stream(tok, ids, skip_special_tokens=True) == ["", "a", "", "", "", "", "😀b", ""]


def test_detokenizer_holds_byte_level_pieces_until_the_character_completes(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    ids = tok.encode("a😀b 日本")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ðŁ", "ĺ", "Ģ", "b", "Ġæ", "Ĺ", "¥", "æľ¬"]
    assert stream(tok, ids) == ["a", "", "", "😀", "b", " ", "", "日", "本", ""]


def test_detokenizer_finish_flushes_an_incomplete_tail_as_decode_does(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte piece never comes
    deltas = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")
