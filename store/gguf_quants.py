"""GGUF tensor types as `.base` records: which are kept exactly, which are re-quantized, which are refused.

The legacy block types are affine groups of 32 values, so each becomes a `base_q{bits}` record
with group size 32 and no loss:

    type   block bytes                    value            .base scale / bias
    Q4_0   d f16 | 16 B nibbles           d * (q - 8)      d / -8d
    Q4_1   d f16 | m f16 | 16 B nibbles   d * q + m        d / m
    Q5_0   d f16 | qh u32 | 16 B nibbles  d * (q - 16)     d / -16d
    Q5_1   d f16 | m f16 | qh | nibbles   d * q + m        d / m
    Q8_0   d f16 | 32 x int8              d * q            d / -128d (codes q + 128)

Nibble byte j holds value j (low half) and value j + 16 (high half); bit j of `qh` is bit 4 of
value j. `-8d`, `-16d` and `-128d` are powers of two times an f16, so they are f16 values too
unless they overflow f16's range; a tensor with such a block keeps f32 scales and biases instead
(f32 holds every f16 exactly). In float32, `scale * q + bias` then equals the GGUF's own
dequantization bit for bit: `d * q` is exact (at most 11 + 8 significant bits), so both round the
same single sum. F32, F16 and BF16 stay float tensors as they are.

K-quants (Q2_K..Q6_K) are read by `gguf_kquants.py`: Q3_K, Q4_K and Q5_K exactly, Q2_K and Q6_K
re-quantized with their error measured; IQ4_NL and IQ4_XS by `gguf_iquants.py`, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baselm.store.base_writer import TensorRecord
from baselm.store.errors import UnsupportedModelError
from baselm.store.quantize import pack_codes

GROUP_SIZE = 32
FLOAT_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


@dataclass(frozen=True, slots=True)
class BlockType:
    """A legacy GGUF block type: bits per value, block bytes, and where its fields sit."""

    bits: int
    block_bytes: int
    has_min: bool  # Q4_1/Q5_1 store the bias m; the others have a fixed zero point
    zero_point: int  # the q that means 0 in the symmetric types


EXACT_TYPES = {
    "Q4_0": BlockType(4, 18, False, 8),
    "Q4_1": BlockType(4, 20, True, 0),
    "Q5_0": BlockType(5, 22, False, 16),
    "Q5_1": BlockType(5, 24, True, 0),
    "Q8_0": BlockType(8, 34, False, 128),
}
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # read by gguf_kquants.py
IQ_TYPES = ("IQ4_NL", "IQ4_XS")  # read by gguf_iquants.py
READABLE = (*FLOAT_TYPES, *EXACT_TYPES, *K_TYPES, *IQ_TYPES, "MXFP4")  # MXFP4: widened exactly (store/mxfp4.py)


def check_readable(type_name: str, tensor: str, label: str) -> None:
    """A clear error for a tensor type base cannot read (IQ*, TQ*, NVFP4, integer types, ...)."""
    if type_name not in READABLE:
        raise UnsupportedModelError(
            f"{label}: tensor {tensor!r} is GGUF type {type_name}, which base cannot read; "
            f"base reads {', '.join(READABLE)} (convert the model to one of those first)"
        )


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of each block (..., n, bytes), as (..., n)."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view("<f2")[..., 0]


def _codes(blocks: np.ndarray, block: BlockType, at: int) -> np.ndarray:
    """The values of blocks (rows, n, bytes), from byte `at` of each, in MLX's packing of a row: as
    bytes or uint32 words, whose rows the caller reads as (rows, in * bits / 32) words."""
    if block.bits == 8:
        return blocks[..., at:] ^ np.uint8(0x80)  # int8 q -> q + 128 as uint8
    if block.bits == 4:
        # Nibble byte j holds values j and j + 16; MLX's byte k holds values 2k and 2k + 1.
        even, odd = blocks[..., at : at + 16 : 2], blocks[..., at + 1 : at + 16 : 2]  # (..., n, 8) each
        packed = np.empty((*blocks.shape[:-1], 16), dtype=np.uint8)  # (..., n, 16)
        np.bitwise_or(even & np.uint8(0x0F), odd << np.uint8(4), out=packed[..., :8])
        np.bitwise_or(even >> np.uint8(4), odd & np.uint8(0xF0), out=packed[..., 8:])
        return packed
    # 5 bits: bit j of the little-endian u32 qh is bit (j % 8) of its byte j // 8, bit 4 of value j.
    q = np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")  # (..., n, 32)
    np.left_shift(q, np.uint8(4), out=q)
    nibbles = blocks[..., at + 4 : at + 20]  # (..., n, 16)
    q[..., :16] |= nibbles & np.uint8(0x0F)
    q[..., 16:] |= nibbles >> np.uint8(4)
    return pack_codes(q.reshape(q.shape[0], -1), 5)


def exact_record(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensor's raw bytes (out, in / 32 * block_bytes) as a lossless record."""
    block = EXACT_TYPES[type_name]
    out_features, in_features = shape
    blocks = raw.reshape(out_features, in_features // GROUP_SIZE, block.block_bytes)  # (out, in/32, bytes)
    d = _halves(blocks, 0)  # (out, in/32)
    if block.has_min:
        scales, biases, scale_dtype = d, _halves(blocks, 2), "f16"
    else:
        scales, biases, scale_dtype = _zero_point_bias(d, block.zero_point)
    codes = _codes(blocks, block, 4 if block.has_min else 2)
    return TensorRecord(
        dtype=f"base_q{block.bits}",
        shape=shape,
        codes=np.ascontiguousarray(codes).view("<u4").reshape(out_features, -1),  # (out, in * bits / 32)
        scales=np.ascontiguousarray(scales),
        biases=np.ascontiguousarray(biases),
        group_size=GROUP_SIZE,
        scale_dtype=scale_dtype,
    )


def _zero_point_bias(d: np.ndarray, zero_point: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(scales, biases, scale dtype) for `w = d * (q - zero_point)`: f16 when every `-zero_point * d`
    is an f16 value, else both in f32 (which holds `d` and the product exactly).

    The product is a power of two times an f16, so in f16 it is exact unless it overflows to inf."""
    bias32 = d.astype(np.float32) * np.float32(-zero_point)
    with np.errstate(over="ignore"):
        bias16 = bias32.astype(np.float16)
    overflow = np.isinf(bias16)
    if not overflow.any() or np.array_equal(overflow, np.isinf(bias32)):
        return d, bias16, "f16"
    return d.astype(np.float32), bias32, "f32"


def float_record(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> TensorRecord:
    """An F32/F16/BF16 tensor as it is (bf16 values held as their uint16 bits)."""
    dtype = FLOAT_TYPES[type_name]
    numpy_dtype = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[dtype]
    data = np.ascontiguousarray(raw.reshape(-1).view(numpy_dtype).reshape(shape))
    return TensorRecord(dtype=dtype, shape=tuple(shape), data=data)
