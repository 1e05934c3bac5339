"""Merges derived from a GGUF vocabulary, kept on disk, so that a file's second load does not derive them again.

A SentencePiece vocabulary with no merges in its file gets them derived from its tokens (Gemma 1-3:
about 515,000 merges from 262,144 tokens, seconds of Python). They are written once, as the pairs of
token ids they merge (an (n, 2) int32 `.npy`), and read back at the next load. (The whole built
tokenizer.json would read back no faster than it builds: `tokenizers` parses its 12 MB more slowly
than it takes the vocabulary and the merges from Python.)

An entry is named by a SHA-256 of everything the build reads (the file's `tokenizer.ggml.*` keys and
its architecture) and of the code that derives the merges (gguf_vocab.py, so a changed derivation
never reads an older one's entry): a vocabulary that differs in anything gets an entry of its own.
An entry that cannot be read back, or whose ids lie outside the vocabulary, is derived again and
rewritten; entries are written whole (a temporary file, then a rename), so no reader sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from baselm.store.default_model import base_home

BUILDER = Path(__file__).with_name("gguf_vocab.py")  # the code whose merges an entry holds
Merges = list[tuple[str, str]]
log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where derived merges are kept: `tokenizers/` under base's home."""
    return base_home() / "tokenizers"


def vocabulary_key(metadata: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) naming the entry of a GGUF vocabulary (see the module docstring)."""
    digest = hashlib.sha256(_builder_digest())
    for key in sorted(k for k in metadata if k.startswith("tokenizer.ggml.") or k == "general.architecture"):
        digest.update(f"\0{key}\0".encode())
        digest.update(json.dumps(metadata[key], ensure_ascii=False).encode())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _builder_digest() -> bytes:
    return hashlib.sha256(BUILDER.read_bytes()).digest()


def cached_merges(
    folder: Path | None,
    metadata: Mapping[str, Any],
    tokens: Sequence[str],
    vocab: Mapping[str, int],
    derive: Callable[[], Merges],
) -> Merges:
    """The merges of a vocabulary (`tokens` as the build spells them, `vocab` their ids): read from
    `folder`, or `derive()`d and written there; None: derived, nothing kept."""
    if folder is None:
        return derive()
    path = folder / f"{vocabulary_key(metadata)}.npy"
    if path.is_file():
        try:
            return _read(path, tokens)
        except (OSError, ValueError, EOFError) as exc:
            log.warning("%s: damaged derived merges (%s); deriving them again", path, exc)
    merges = derive()
    _write(path, np.array([(vocab[a], vocab[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2))
    return merges


def _read(path: Path, tokens: Sequence[str]) -> Merges:
    pairs = np.load(path, allow_pickle=False)  # (num_merges, 2) int32
    if pairs.dtype != np.int32 or pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"holds a {pairs.dtype} array of shape {pairs.shape}, not (n, 2) int32")
    if pairs.size and not (0 <= int(pairs.min()) and int(pairs.max()) < len(tokens)):
        raise ValueError(f"holds ids outside the vocabulary of {len(tokens)}")
    return [(tokens[a], tokens[b]) for a, b in pairs.tolist()]


def _write(path: Path, pairs: np.ndarray) -> None:
    """`pairs` as `path`, whole or not at all; a folder that cannot be written costs only the next load a derivation."""
    staged: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            staged = Path(f.name)
            np.save(f, pairs, allow_pickle=False)
        os.replace(staged, path)
    except OSError as exc:
        log.warning("%s: cannot keep derived merges (%s)", path.parent, exc)
        if staged is not None:
            staged.unlink(missing_ok=True)
