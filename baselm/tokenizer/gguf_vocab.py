"""The `tokenizers` backend a GGUF file's tokenizer metadata describes.

`tokenizer.ggml.model` 'gpt2' is a byte-level BPE whose split `tokenizer.ggml.pre` picks
(`gguf_splits.py`); 'llama' is a SentencePiece BPE with byte fallback, its merges read from the
file or derived from the token scores (in Gemma 1-3 files, from the vocabulary's order); 'gemma4'
a BPE over "▁"-spelled lines with byte fallback; 'bert' a WordPiece. Control tokens become
special added tokens, user-defined ones plain added tokens. A SentencePiece vocabulary gives the
ids transformers gives for the same file (`AutoTokenizer.from_pretrained(..., gguf_file=...)`), also
where it departs from llama.cpp (`_sentencepiece_backend` says where). For a byte-level split whose
transformers reading departs from the model's own tokenizer, base follows the model, as llama.cpp
does (`gguf_splits.py`). llama.cpp's own tokenizer test vectors pass
(tests/tokenizer/test_llama_cpp_vocabs.py), except the texts transformers reads otherwise in Llama 2's
SentencePiece file (tests/tokenizer/test_llama_spm_gguf.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.gguf_splits import byte_level_split
from baselm.tokenizer.vocab_cache import cached_merges

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Architectures whose 'llama' (SentencePiece) vocabulary is Gemma's: no "▁" prefix, merges in vocabulary
# order. Gemma 3n and EmbeddingGemma files carry Gemma 3's vocabulary.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")
# Architectures whose 'llama' vocabulary transformers reads with a "▁" before every run of text (Phi-3's).
_PREPEND_EVERY_RUN = ("phi3",)


def gguf_backend(metadata: Mapping[str, Any], cache: Path | None = None) -> Backend:
    """The vocabulary, split and decoder of a GGUF's tokenizer metadata, with its added tokens.

    Supports `tokenizer.ggml.model` 'gpt2', 'llama', 'gemma4' and 'bert'; anything else is a
    TokenizerError naming it. With `cache` (a folder), the merges base derives for a SentencePiece
    vocabulary whose file has none (the costly part of a build) are kept there and read back after
    (vocab_cache.py).
    """
    kind = metadata.get("tokenizer.ggml.model")
    if not metadata.get("tokenizer.ggml.tokens"):
        raise TokenizerError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind not in _BUILDERS:
        supported = ", ".join(repr(k) for k in _BUILDERS)
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: {supported})")
    if kind == "llama":
        is_gemma = metadata.get("general.architecture") in _GEMMA_ARCHITECTURES
        backend, vocab = (_gemma_backend if is_gemma else _sentencepiece_backend)(metadata, cache)
    else:
        backend, vocab = _BUILDERS[kind](metadata)
    _add_gguf_tokens(backend, metadata, vocab, byte_level=kind == "gpt2")
    return backend


def gguf_special_tokens(metadata: Mapping[str, Any]) -> dict[str, str | None]:
    """bos/eos/unk/pad tokens named by the metadata's `tokenizer.ggml.*_id` keys (None: none named)."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    # A WordPiece (BERT) vocabulary frames a text with CLS ... SEP where others use BOS ... EOS.
    return {
        "bos_token": token_at("bos_token_id") or token_at("cls_token_id"),
        "eos_token": token_at("eos_token_id") or token_at("seperator_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }


def gguf_end_of_turn_ids(metadata: Mapping[str, Any]) -> list[int]:
    """Ids besides EOS that end a generation: end of turn and of message (`tokenizer.ggml.eot_token_id`,
    `eom_token_id`), and a Gemma 1-3 file's `<end_of_turn>`, which its files do not name but Gemma's
    generation_config lists and llama.cpp stops on."""
    keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [metadata[k] for k in keys if isinstance(metadata.get(k), int)]
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata.get("tokenizer.ggml.token_type") or []
    if metadata.get("general.architecture") in _GEMMA_ARCHITECTURES and "<end_of_turn>" in tokens:
        i = tokens.index("<end_of_turn>")
        ids += [i] if i < len(types) and types[i] == _CONTROL else []
    return ids


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _outside_alphabet() -> re.Pattern[str]:
    """Matches a character that is not in the byte alphabet."""
    return re.compile("[^" + re.escape("".join(sorted(_byte_alphabet().values()))) + "]")


def _byte_level_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or []
    spelling = _byte_alphabet()
    # A token spelled outside the byte alphabet is respelled as its bytes, except a user-defined
    # one: it is matched whole in the text as it is written (MPT's runs of spaces). Such tokens
    # are few, so the regex finds them and the rest stay as they are (a 150k vocabulary in ms).
    outside = _outside_alphabet().search
    keys = list(tokens)
    for i in [i for i, token in enumerate(tokens) if outside(token)]:
        if i >= len(types) or types[i] != _USER_DEFINED:
            keys[i] = "".join(spelling[b] for b in tokens[i].encode("utf-8"))
    vocab = dict(zip(keys, range(len(keys))))  # as a comprehension would: a repeated key keeps its last id
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    split = byte_level_split(metadata.get("tokenizer.ggml.pre") or "default")
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=split.ignore_merges))
    backend.pre_tokenizer = split.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_backend(metadata: Mapping[str, Any], cache: Path | None = None) -> tuple[Backend, dict[str, int]]:
    """A SentencePiece vocabulary (Llama 2, Mistral, Phi-3 ...) as a byte-fallback BPE, as transformers
    builds it from the same GGUF (tests/tokenizer/test_llama_spm_gguf.py holds its ids).

    NOTE: where the "▁" goes that marks a text's first word, llama.cpp and transformers part:
    - llama.cpp (and Llama 2's own legacy tokenizer.json, whose ids llama.cpp's test vectors hold)
      puts one before every run of text: the first, one that already starts with a space (" hi" is
      "▁▁hi"), and each run after a special token ("<s>hi" is "<s>", "▁hi"); and it puts none where
      the file's `tokenizer.ggml.add_space_prefix` is false.
    - transformers reads a 'llama' GGUF as its current `LlamaTokenizer`: a Metaspace that prepends
      "▁" to the text's first run only, and not when it starts with a space already (" hi" is "▁hi",
      "<s>hi" is "<s>", "hi"), whatever `add_space_prefix` says; except for Phi-3 files, which it
      reads with llama.cpp's rule (a "▁" prepended to every run, by the normalizer).
    base follows transformers: the ids a GGUF gives must be those transformers gives for the same
    file, as for every other vocabulary; the decode strips the one leading space the mark adds.
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise TokenizerError("the GGUF SentencePiece vocabulary has neither merges nor one score per token")
        merges = cached_merges(cache, metadata, tokens, vocab, lambda: _merges_from_scores(tokens, scores, vocab))
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    if metadata.get("general.architecture") in _PREPEND_EVERY_RUN:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _gemma_backend(metadata: Mapping[str, Any], cache: Path | None = None) -> tuple[Backend, dict[str, int]]:
    """Gemma 1-3's SentencePiece BPE: spaces spelled "▁" with none prepended, byte fallback.

    NOTE: as transformers reads these files (tests/tokenizer/test_gemma_gguf.py). llama.cpp's
    converter writes the runs of two or more spaces as spaces ("  "), which Gemma's own vocabulary
    spells "▁▁": they are respelled so the merges that build them apply. The scores do not follow
    Gemma's merge order (every added and control token has the same one), the vocabulary's order
    does, so the merges are ranked by id.
    """
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in metadata["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    merges = merges or cached_merges(cache, metadata, tokens, vocab, lambda: _merges_in_vocabulary_order(vocab))
    unk = gguf_special_tokens(metadata)["unk_token"]
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def _gemma4_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """Gemma 4's BPE: spaces spelled "▁", no leading "▁", merges over whole lines, byte fallback."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def _wordpiece_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """A BERT WordPiece vocabulary, lower-casing as BERT's uncased tokenizers do.

    llama.cpp's converter spells a word-start piece "▁word" and a continuation "word"; WordPiece
    spells them "word" and "##word".
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        key = token if kind == _CONTROL else token[1:] if token.startswith("▁") else "##" + token
        vocab.setdefault(key, i)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else "[UNK]"
    backend = Backend(models.WordPiece(vocab, unk_token=unk_token, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return backend, vocab


# `tokenizer.ggml.model` -> the builder of its vocabulary ('llama': Gemma's or the others', by architecture)
_BUILDERS = {
    "gpt2": _byte_level_backend,
    "llama": _sentencepiece_backend,
    "gemma4": _gemma4_backend,
    "bert": _wordpiece_backend,
}


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens.

    Ranked by the merged token's score (highest first), then longer left and right pieces
    first; ties keep vocabulary order. This is the order transformers derives.
    """
    candidates = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _merges_in_vocabulary_order(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The merges `_merges_from_scores` derives when each token's score is minus its id: tokens
    in vocabulary order, each one's splits longest left piece first (without sorting every candidate)."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):  # a repeated token ranks by its last id, as there
        merges.extend(
            (token[:k], token[k:]) for k in range(len(token) - 1, 0, -1) if token[:k] in vocab and token[k:] in vocab
        )
    return merges


def _add_gguf_tokens(backend: Backend, metadata: Mapping[str, Any], vocab: Mapping[str, int], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    mislabel by the converter and is left alone (adding it would grow the vocabulary).
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or []
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)
