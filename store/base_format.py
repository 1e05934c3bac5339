"""The `.base` container format (versions 1 to 4): its layout, alignment, size and checksum rules.

Layout (all integers little-endian):

    0x00  b"BASE" | u32 version (1 to 4) | u64 header_len | header JSON (UTF-8, header_len bytes)
          zero padding to the next 64 KiB boundary            <- blob start
          tensor blob: one region per tensor, each aligned     <- offsets are blob-relative
          (optional slots after the last region)

The header is canonical JSON (sorted keys, compact separators, ASCII with escapes, no NaN),
so the same inputs give the same bytes. Offsets are relative to the blob start, which makes
the tensor layout independent of the header's length: the writer streams the blob first and
writes the header last (see `write_base_file`).

Alignment rule: a "matrix" region (every quantized or block tensor, and every float tensor of two
or more dimensions) starts on a 16 KiB boundary, the page size of Apple GPUs, so each weight can
later be wrapped as its own no-copy Metal buffer; every other region (norms, biases, scalars)
starts on a 64-byte boundary.

A quantized tensor (`base_q2` .. `base_q8`) is one region `[codes | scales | biases]` with no
gaps: codes are MLX's affine packing, uint32 `(out, in * bits / 32)`; scales and biases are
`(out, in / group_size)` in `scale_dtype`; `w = scale * q + bias`. They load straight into
`mx.quantized_matmul` / `mx.dequantize`.

A block tensor holds a GGUF matrix exactly as llama.cpp writes it (`baselm/gguf_blocks.py`): one
region of the rows' bytes, uint8 `(out, in / block_values * block_bytes)`, shape 2-D `(out, in)`
with `in` a multiple of the block's values, no scales or biases (each block carries its own). Its
entry has the float entry's keys. The block dtypes, their values a block and bits per weight:
`gguf_q4_k` 256, 4.5; `gguf_q5_k` 256, 5.5; `gguf_q6_k` 256, 6.5625 (the K-quants of version 2);
`gguf_q4_0` 32, 4.5; `gguf_q4_1` 32, 5; `gguf_q5_0` 32, 5.5; `gguf_q5_1` 32, 6; `gguf_q8_0` 32, 8.5
(the legacy blocks of version 3); `gguf_q2_k` 256, 2.625; `gguf_q3_k` 256, 3.4375; `gguf_iq4_nl` 32,
4.5; `gguf_iq4_xs` 256, 4.25 (version 4).

Versions: a file is written as the highest version its block dtypes need (`gguf_q2_k`, `gguf_q3_k`,
`gguf_iq4_nl`, `gguf_iq4_xs`: 4; the legacy `gguf_q4_0` ... `gguf_q8_0`: 3; `gguf_q4_k`,
`gguf_q5_k`, `gguf_q6_k`: 2), a file without block tensors version 1 (byte for byte what a
version-1-only writer makes), so a build that does not know a file's block dtypes refuses it by
its version alone. A block dtype in a file of a lower version than its own is an error.

`checksum_xxh64` (16 hex digits) covers each tensor's whole region; `header_xxh64` covers the
header itself (its canonical JSON without that key). Both are checked on request (`verify`).

Writer (`base_writer.py`) and reader (`base_reader.py`, validated by `base_header.py`) share
every rule here, so they cannot drift apart.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from baselm import gguf_blocks

MAGIC = b"BASE"
VERSION = 1  # a file of float and affine tensors only
VERSIONS = (1, 2, 3, 4)  # 2: K-quant blocks; 3: legacy blocks; 4: Q2_K, Q3_K, IQ4 blocks (BlockType.base_version)
SCHEMA = "base.v1"
PREAMBLE = struct.Struct("<4sIQ")  # magic, version, header_len
BLOB_ALIGN = 64 * 1024
MATRIX_ALIGN = 16 * 1024
VECTOR_ALIGN = 64
ALIGNMENT = {"blob": BLOB_ALIGN, "matrix": MATRIX_ALIGN, "vector": VECTOR_ALIGN}
# A header is config + tokenizer + tensor table; far below this even for 200k-token vocabularies.
MAX_HEADER_LEN = 256 * 1024 * 1024
MAX_NDIM = 8
GROUP_SIZES = (32, 64, 128)

# Float dtypes as stored: numpy dtype of the raw little-endian values (bf16 as its uint16 bits).
FLOAT_DTYPES: dict[str, np.dtype] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}
QUANT_BITS = {f"base_q{b}": b for b in (2, 3, 4, 5, 6, 8)}
BLOCK_DTYPES = tuple(gguf_blocks.BY_DTYPE)  # gguf_q4_0 ... gguf_q8_0, gguf_iq4_nl, gguf_q2_k ... gguf_iq4_xs
DTYPES = (*FLOAT_DTYPES, *QUANT_BITS, *BLOCK_DTYPES)
HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "arch": (str,),
    "config": (dict,),
    "tokenizer": (dict,),
    "quant_scheme": (str,),
    "quant_profile": (str, dict, type(None)),
    "source": (dict,),
    "alignment": (dict,),
    "flags": (list,),
    "created": (str,),
    "tensors": (list,),
    "header_xxh64": (str,),
}
# Keys a header may hold besides those above: an embedded signature (see signing.py).
OPTIONAL_HEADER_TYPES: dict[str, tuple[type, ...]] = {"signature": (dict,)}
# The MLX dtype of each stored float dtype.
MX_DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def region_sizes(
    dtype: str, shape: tuple[int, ...], group_size: int | None, scale_dtype: str | None
) -> tuple[int, int]:
    """(data or codes bytes, scales bytes) of a region; biases take as many bytes as scales."""
    numel = math.prod(shape)
    if dtype in FLOAT_DTYPES:
        return numel * FLOAT_DTYPES[dtype].itemsize, 0
    out_features, in_features = shape
    if dtype in BLOCK_DTYPES:
        return out_features * gguf_blocks.row_bytes(dtype, in_features), 0
    codes = out_features * in_features * QUANT_BITS[dtype] // 8
    scales = out_features * (in_features // group_size) * FLOAT_DTYPES[scale_dtype].itemsize
    return codes, scales


def region_alignment(dtype: str, shape: tuple[int, ...]) -> int:
    """16 KiB for matrix regions (quantized, blocks or >= 2-D), 64 B for the rest."""
    return MATRIX_ALIGN if dtype in QUANT_BITS or dtype in BLOCK_DTYPES or len(shape) >= 2 else VECTOR_ALIGN


def dtype_version(dtype: str) -> int:
    """The first version that holds tensors of `dtype`: 1 but for the block dtypes."""
    block_type = gguf_blocks.BY_DTYPE.get(dtype)
    return VERSION if block_type is None else block_type.base_version


def file_version(dtypes: Iterable[str]) -> int:
    """The version a file of tensors of `dtypes` is written as: the highest its dtypes need."""
    return max((dtype_version(dtype) for dtype in dtypes), default=VERSION)


def align(value: int, alignment: int) -> int:
    """`value` rounded up to a multiple of `alignment`."""
    return -(-value // alignment) * alignment


def canonical_json(obj: Any) -> bytes:
    """The one serialization of a header: sorted keys, compact, ASCII (escapes keep even lone
    surrogates of odd vocabularies intact), no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def header_checksum(header: dict[str, Any]) -> str:
    """xxh64 of the header's canonical JSON without its own `header_xxh64` key."""
    body = {k: v for k, v in header.items() if k != "header_xxh64"}
    return xxhash.xxh64(canonical_json(body)).hexdigest()


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float values (bf16 as its uint16 bits) as float32."""
    if dtype == "bf16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def float_numpy(array: np.ndarray | mx.array) -> tuple[np.ndarray, str]:
    """(little-endian numpy values, dtype name) of a float array; bf16 comes back as uint16 bits."""
    if isinstance(array, mx.array):
        if array.dtype == mx.bfloat16:
            return np.array(array.view(mx.uint16)), "bf16"
        names = {mx.float32: "f32", mx.float16: "f16"}
        if array.dtype not in names:
            raise ValueError(f"cannot store an MLX array of dtype {array.dtype}; use a float dtype")
        return np.array(array), names[array.dtype]
    names = {np.dtype("float32"): "f32", np.dtype("float16"): "f16"}
    dtype = np.dtype(array.dtype)
    if dtype.newbyteorder("=") not in names:
        raise ValueError(f"cannot store a numpy array of dtype {dtype}; use float32 or float16 (or an MLX bf16 array)")
    name = names[dtype.newbyteorder("=")]
    return np.asarray(array, dtype=FLOAT_DTYPES[name]), name
