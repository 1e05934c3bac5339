"""Small real `.base` files, and helpers that rewrite their header, for the store's tests."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.store.base_format import BLOB_ALIGN, PREAMBLE, canonical_json
from baselm.store.base_writer import write_base_file
from baselm.store.quantize import quantize

CREATED = "2026-01-01T00:00:00+00:00"
Q_NAME = "model.layers.0.self_attn.q_proj.weight"
NORM_NAME = "model.layers.0.input_layernorm.weight"
HEADER_FIELDS: dict[str, Any] = {
    "arch": "llama",
    "config": {"model_type": "llama", "hidden_size": 64, "rms_norm_eps": 1e-05},
    "tokenizer": {
        "tokenizer.json": '{"model": {}}',
        "tokenizer_config.json": {"eos_token": "</s>"},
        "chat_template": None,
    },
    "quant_scheme": "q4",
    "quant_profile": "default-q4",
    "source": {"format": "gguf", "repo": "local/tiny", "revision": None, "sha256": "00" * 32},
    "flags": ["tied_embeddings"],
    "created": CREATED,
}


def small_tensors(seed: int = 0) -> list[tuple[str, Any]]:
    """A few tensors of every kind: q4 and q3 (f16 scales), q8 (bf16 scales), f32/f16/bf16 floats."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((8, 128)).astype(np.float32)  # (out, in)
    w2 = rng.standard_normal((4, 64)).astype(np.float32)  # (out, in)
    w3 = rng.standard_normal((6, 128)).astype(np.float32)  # (out, in)
    return [
        ("model.layers.0.self_attn.q_proj.weight", quantize(w1, 4, 64, "f16")),
        ("model.layers.0.input_layernorm.weight", rng.standard_normal(64).astype(np.float32)),
        ("model.layers.0.mlp.down_proj.weight", quantize(w2, 3, 32, "f16")),
        ("model.embed_tokens.weight", quantize(w3, 8, 128, "bf16")),
        ("model.norm.weight", mx.array(rng.standard_normal(64).astype(np.float32)).astype(mx.bfloat16)),
        ("lm_head.bias", rng.standard_normal(6).astype(np.float16)),
        ("model.extra.weight", rng.standard_normal((3, 5)).astype(np.float16)),
    ]


def write_small(path: Path, **overrides: Any) -> Path:
    return write_base_file(path, small_tensors(), **{**HEADER_FIELDS, **overrides})


def split_file(path: Path) -> tuple[dict[str, Any], bytes]:
    """(header dict, blob bytes) of a file our writer made."""
    data = path.read_bytes()
    _, _, header_len = PREAMBLE.unpack_from(data)
    blob_start = -(-(PREAMBLE.size + header_len) // BLOB_ALIGN) * BLOB_ALIGN
    return json.loads(data[PREAMBLE.size : PREAMBLE.size + header_len]), data[blob_start:]


def assemble(path: Path, header_bytes: bytes, blob: bytes, header_len: int | None = None, version: int = 1) -> Path:
    """Writes preamble + header + zero padding + blob, the way the format lays them out."""
    blob_start = -(-(PREAMBLE.size + len(header_bytes)) // BLOB_ALIGN) * BLOB_ALIGN
    padding = bytes(blob_start - PREAMBLE.size - len(header_bytes))
    preamble = struct.pack("<4sIQ", b"BASE", version, len(header_bytes) if header_len is None else header_len)
    path.write_bytes(preamble + header_bytes + padding + blob)
    return path


def rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> Path:
    """Applies `mutate` to the header dict and writes the file again with the same blob."""
    header, blob = split_file(path)
    mutate(header)
    return assemble(path, canonical_json(header), blob)


def entry(header: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in header["tensors"] if t["name"] == name)
