"""GGUF vocabularies: the split `tokenizer.ggml.pre` names, SentencePiece prefixes, turn ids, refusals."""

from __future__ import annotations

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import GGUF_TOKENIZER_FIXTURES, TOKENIZER_FIXTURES
from tests.tokenizer.conftest import load


def test_pre_tokenizer_names_pick_their_split_of_digits():
    # One vocabulary, four `tokenizer.ggml.pre`: GPT-2 lets BPE merge across digits, llama-bpe
    # cuts numbers into runs of at most three digits first, qwen2 and smollm into single digits.
    def pieces(pre: str) -> list[str]:
        tok = load(f"bpe-{pre}.gguf")
        return [tok.id_to_token(i) for i in tok.encode("in 2024, 31415926")]

    assert pieces("gpt2") == ["in", "Ġ2024", ",", "Ġ314", "15", "9", "2", "6"]
    assert pieces("llama-bpe") == ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "3", "14", "15", "9", "2", "6"]
    singles = ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "3", "1", "4", "1", "5", "9", "2", "6"]
    assert pieces("qwen2") == singles
    assert pieces("smollm") == singles


def test_gguf_end_of_turn_id_ends_generation_too():
    metadata = dict(read_metadata(TOKENIZER_FIXTURES / "bpe-gpt2.gguf")[1])
    metadata["tokenizer.ggml.eot_token_id"] = 1
    assert Tokenizer.from_gguf_metadata(metadata).eos_token_ids == (2, 1)


def test_unknown_gguf_pre_tokenizer_and_model_are_refused():
    metadata = dict(read_metadata(TOKENIZER_FIXTURES / "bpe-gpt2.gguf")[1])
    with pytest.raises(TokenizerError, match="pre-tokenizer 'made-up' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "made-up"})
    with pytest.raises(TokenizerError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "t5"})
    with pytest.raises(TokenizerError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_gguf_sentencepiece_space_prefix_flag_is_read_as_transformers_reads_it_not_at_all():
    # llama.cpp leaves the "▁" out where `add_space_prefix` is false; transformers ignores the flag.
    metadata = {**read_metadata(TOKENIZER_FIXTURES / "spm.gguf")[1], "tokenizer.ggml.add_space_prefix": False}
    tok, with_prefix = Tokenizer.from_gguf_metadata(metadata), load("spm.gguf")
    for text in ("hello", " hi", "<s>hello there"):
        assert tok.encode(text, add_special_tokens=False) == with_prefix.encode(text, add_special_tokens=False)


def test_gguf_sentencepiece_of_gemma_adds_no_space_mark_and_ranks_merges_by_vocabulary_order():
    # Any Gemma 1-3 architecture gets Gemma's reading of a 'llama' vocabulary (test_gemma_gguf.py
    # checks it against transformers), whatever the file's own add_space_prefix and scores say.
    metadata = dict(read_metadata(GGUF_TOKENIZER_FIXTURES / "gemma3-small.gguf")[1])
    metadata["tokenizer.ggml.scores"] = [0.0] * len(metadata["tokenizer.ggml.tokens"])
    for arch in ("gemma", "gemma2", "gemma3"):
        tok = Tokenizer.from_gguf_metadata({**metadata, "general.architecture": arch})
        pieces = [tok.id_to_token(i) for i in tok.encode("the cat sat", add_special_tokens=False)]
        assert pieces[0] == "the" and "".join(pieces) == "the▁cat▁sat"


def test_gguf_sentencepiece_puts_a_space_mark_before_the_first_run_of_text_alone():
    # transformers' rule (llama.cpp's differs: it puts "▁" before every run, also one that starts with a
    # space or follows a special token such as BOS; see gguf_vocab._sentencepiece_backend).
    tok = load("spm.gguf")
    pieces = [tok.id_to_token(i) for i in tok.encode(" hello", add_special_tokens=False)]
    assert "".join(pieces) == "▁hello"
    after_bos = tok.encode("<s>hello", add_special_tokens=False)
    assert after_bos[0] == tok.bos_token_id
    assert "".join(tok.id_to_token(i) for i in after_bos[1:]) == "hello"
    assert tok.decode(tok.encode(" hello", add_special_tokens=False)) == "hello"


def test_a_phi3_sentencepiece_puts_a_space_mark_before_every_run_of_text():
    # transformers reads a Phi-3 file with llama.cpp's rule (test_pre_tokenizer_names.py holds its ids).
    metadata = {**read_metadata(TOKENIZER_FIXTURES / "spm.gguf")[1], "general.architecture": "phi3"}
    tok = Tokenizer.from_gguf_metadata(metadata)
    pieces = [tok.id_to_token(i) for i in tok.encode(" hello", add_special_tokens=False)]
    assert "".join(pieces) == "▁▁hello"
    after_bos = tok.encode("<s>hello", add_special_tokens=False)
    assert "".join(tok.id_to_token(i) for i in after_bos[1:]) == "▁hello"
    assert tok.decode(tok.encode(" hello", add_special_tokens=False)) == " hello"
