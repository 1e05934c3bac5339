"""GGUF's IQ4_NL and IQ4_XS as exact affine `.base` records: 8-bit codes over each block's scale.

This is the form for the paths that run no block kernel (a GPU, a sharded or adapted model, the
generic CPU build) and for a pull asked for a quant; `base pull` of such a file stores its
matrices as their blocks (`gguf_iq4_nl`, `gguf_iq4_xs`: baselm/gguf_blocks.py) instead.

Both index the same 16 int8 levels (llama.cpp's `kvalues_iq4nl`, IQ4_LEVELS below) with 4-bit codes:

    type    block                                            value
    IQ4_NL  32 values: d f16 | 16 B nibbles                  d * level[q]
    IQ4_XS  256 values: d f16 | scales_h u16 | scales_l[4]   d * (ls - 32) * level[q], ls the 6-bit
            | 128 B nibbles (8 blocks of 32, 16 B each)      scale of each block of 32

Nibble byte j of a block of 32 holds value j (low half) and value j + 16 (high half); block j's
`ls` is nibble j % 2 of scales_l[j / 2] with bits 2j, 2j + 1 of scales_h above it. As a `base_q8`
record a block of 32 takes codes level[q] + 128 (1 to 241), scale s (d, or d * (ls - 32): exact in
float32, 11 + 6 significant bits) and bias -128 s (a power of two times s): `s * code + bias` is
then `s * level[q]` exactly, llama.cpp's value bit for bit.
"""

from __future__ import annotations

import numpy as np

from baselm.store.base_writer import TensorRecord
from baselm.store.gguf_kquants import by_rows, exact_affine_record

GROUP_SIZE = 32
SUPER_BLOCK = 256
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
IQ4_TYPES = {"IQ4_NL": (GROUP_SIZE, 18), "IQ4_XS": (SUPER_BLOCK, 136)}  # values and bytes a block
OFFSET = 128


def iq4_record(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
    """An IQ4_NL/IQ4_XS matrix's raw bytes (rows, row bytes) as an exact `base_q8` record (groups of 32),
    a few rows at a time (`by_rows`)."""
    return by_rows(raw, shape, lambda part, part_shape: _iq4_part(type_name, part, part_shape))


def _iq4_part(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
    rows, cols = shape
    values, num_bytes = IQ4_TYPES[type_name]
    blocks = raw.reshape(rows, cols // values, num_bytes)  # (rows, n, bytes)
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)  # (rows, n)
    if type_name == "IQ4_NL":
        scales, nibbles = d, blocks[..., 2:]  # (rows, cols / 32), (rows, cols / 32, 16)
    else:
        scales = (d[..., None] * (_iq4xs_scales(blocks) - 32)).reshape(rows, -1)  # (rows, cols / 32)
        nibbles = blocks[..., 8:].reshape(rows, -1, 16)  # (rows, cols / 32, 16)
    levels = np.concatenate([IQ4_LEVELS[nibbles & 15], IQ4_LEVELS[nibbles >> 4]], axis=-1)  # (rows, cols / 32, 32)
    codes = (levels + OFFSET).astype(np.uint8).reshape(rows, cols)
    return exact_affine_record(8, shape, codes, scales, scales * np.float32(-OFFSET))


def _iq4xs_scales(blocks: np.ndarray) -> np.ndarray:
    """(rows, n, 8) the 6-bit scales ls of IQ4_XS super-blocks (rows, n, 136), as float32."""
    high = blocks[..., 2].astype(np.int32) | blocks[..., 3].astype(np.int32) << 8  # (rows, n) scales_h
    j = np.arange(8)
    low = (blocks[..., 4 + j // 2] >> (4 * (j % 2))) & 15  # (rows, n, 8)
    return (low | ((high[..., None] >> (2 * j)) & 3) << 4).astype(np.float32)
