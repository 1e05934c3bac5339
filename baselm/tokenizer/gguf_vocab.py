"""The `tokenizers` backend a GGUF file's tokenizer metadata describes.

`tokenizer.ggml.model` 'gpt2' is a byte-level BPE whose split `tokenizer.ggml.pre` picks;
'llama' is a SentencePiece BPE with byte fallback, its merges read from the file or derived
from the token scores. Control tokens become special added tokens, user-defined ones plain
added tokens. Where transformers departs from the model's own tokenizer for a GGUF, we follow
the model (see `_SPLITS` and `_sentencepiece_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from baselm.tokenizer.errors import TokenizerError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns. GPT-2's own pattern is the one `ByteLevel(use_regex=True)` applies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split family. "digits-gpt2" isolates every digit, then splits like
# GPT-2: what SmolLM2's and StarCoder's tokenizer.json do (transformers gives these GGUFs the
# plain GPT-2 split, which tokenizes numbers differently for vocabularies with digit merges).
_SPLITS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "smollm": "digits-gpt2",
    "starcoder": "digits-gpt2",
    "refact": "digits-gpt2",
}


def gguf_backend(metadata: Mapping[str, Any]) -> Backend:
    """The vocabulary, split and decoder of a GGUF's tokenizer metadata, with its added tokens.

    Supports `tokenizer.ggml.model` 'gpt2' and 'llama'; anything else is a TokenizerError.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if not metadata.get("tokenizer.ggml.tokens"):
        raise TokenizerError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        backend, vocab = _byte_level_backend(metadata)
    elif kind == "llama":
        backend, vocab = _sentencepiece_backend(metadata)
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    _add_gguf_tokens(backend, metadata, vocab, byte_level=kind == "gpt2")
    return backend


def gguf_special_tokens(metadata: Mapping[str, Any]) -> dict[str, str | None]:
    """bos/eos/unk/pad tokens named by the metadata's `tokenizer.ggml.*_id` keys (None: none named)."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    return {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }


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


def _byte_level_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    tokens = metadata["tokenizer.ggml.tokens"]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a stray added token) is respelled as its bytes.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_split(metadata.get("tokenizer.ggml.pre") or "default")
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _byte_level_split(pre: str) -> pre_tokenizers.PreTokenizer:
    family = _SPLITS.get(pre)
    if family is None:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_SPLITS))}); "
            "convert the model from its HF folder instead"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits-gpt2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    pattern = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """SentencePiece vocabulary as a byte-fallback BPE, the way transformers builds it.

    NOTE: a file with `tokenizer.ggml.add_space_prefix = false` gets no leading "▁" (as in
    llama.cpp); transformers ignores that flag.
    """
    arch = metadata.get("general.architecture")
    if arch in ("gemma", "gemma2", "gemma3", "phi3"):
        raise TokenizerError(f"GGUF SentencePiece tokenizers of {arch!r} models are not supported yet")
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise TokenizerError("the GGUF SentencePiece vocabulary has neither merges nor one score per token")
        merges = _merges_from_scores(tokens, scores, vocab)
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


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
