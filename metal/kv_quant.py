"""Quantized KV pools (q8, q4): the storage contract shared by the reference and the kernels.

A quantized pool holds, per slot and KV head, one row of `head_dim` values as affine codes:

    value = scale * code + bias        per group of `group_size` values along head_dim

- `codes`  (num_blocks, block_size, kv_heads, head_dim * bits / 32) uint32, MLX's affine
  packing: value i of a row sits in word i * bits // 32 at bit (i * bits) % 32.
- `scales`, `biases`  (num_blocks, block_size, kv_heads, head_dim / group_size), in the
  pool's float dtype.

Group size: 32 when head_dim is a multiple of 32 (64, 96, 128, 256), else 16 (80). A row
is quantized alone when it is written, so a group never spans two tokens or two heads;
32 keeps the q4 error small (scale + bias cost 1 bit per value in float16) while every
group still covers whole 4-value chunks, which the kernels read as one unit.

Quantizing (the kernels follow the same steps, in float32):
    lo, hi = min, max of the group; scale = (hi - lo) / (2**bits - 1) rounded to the pool
    dtype, bias = lo rounded to the pool dtype; code = clip(round((x - bias) * (1 / scale)),
    0, 2**bits - 1), code = 0 when scale == 0.
So |x - dequantized| <= scale / 2 plus the rounding of bias to the pool dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

KV_BITS = (16, 8, 4)


class QuantizedPool(NamedTuple):
    """One quantized K or V pool; a plain tuple of arrays, so `mx.eval` takes it as is."""

    codes: mx.array  # (num_blocks, block_size, kv_heads, head_dim * bits // 32) uint32
    scales: mx.array  # (num_blocks, block_size, kv_heads, head_dim // group_size)
    biases: mx.array  # (num_blocks, block_size, kv_heads, head_dim // group_size)
    bits: int
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        """The float dtype of the values the pool stands for."""
        return self.scales.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape, as a float pool would have: (num_blocks, block_size, kv_heads, head_dim)."""
        return (*self.codes.shape[:3], self.head_dim)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes


Pool = mx.array | QuantizedPool


def kv_group_size(head_dim: int) -> int:
    """Values per scale/bias group along head_dim for a quantized pool."""
    if head_dim % 32 == 0:
        return 32
    if head_dim % 16 == 0:
        return 16
    raise ValueError(f"a quantized KV cache needs head_dim divisible by 16, got {head_dim}")


Zeros = Callable[[tuple[int, ...], mx.Dtype], mx.array]


def allocate_pool(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    kv_bits: int = 16,
    zeros: Zeros = mx.zeros,
) -> Pool:
    """A zeroed K or V pool: a float array for kv_bits=16, else a QuantizedPool of `dtype` scales.
    `zeros(shape, dtype)` makes each array (the CPU's lazily mapped zeros, say)."""
    if kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS}, got {kv_bits}")
    if kv_bits == 16:
        return zeros((num_blocks, block_size, kv_heads, head_dim), dtype)
    group_size = kv_group_size(head_dim)
    lead = (num_blocks, block_size, kv_heads)
    codes = zeros((*lead, head_dim * kv_bits // 32), mx.uint32)
    scales = zeros((*lead, head_dim // group_size), dtype)
    biases = zeros((*lead, head_dim // group_size), dtype)
    return QuantizedPool(codes, scales, biases, kv_bits, group_size)


def quantize_rows(x: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """Affine-quantizes rows (..., head_dim) into (codes, scales, biases) as a pool stores them."""
    head_dim = x.shape[-1]
    lead = x.shape[:-1]
    groups = x.astype(mx.float32).reshape(*lead, head_dim // group_size, group_size)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)  # (..., num_groups)
    levels = 2**bits - 1
    scales = ((hi - lo) / levels).astype(dtype)
    biases = lo.astype(dtype)
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    inv = mx.where(s32 > 0, 1.0 / mx.where(s32 > 0, s32, 1.0), 0.0)
    q = mx.round((groups - b32[..., None]) * inv[..., None])
    q = mx.clip(q, 0, levels).astype(mx.uint32).reshape(*lead, head_dim // (32 // bits), 32 // bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)  # (32 // bits,)
    codes = mx.sum(q << shifts, axis=-1).astype(mx.uint32)  # disjoint bits: the sum is an OR
    return codes, scales, biases


def dequantize_rows(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """The float rows (..., head_dim), in the scales' dtype, that quantized codes stand for."""
    lead = codes.shape[:-1]
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)  # (32 // bits,)
    q = (codes[..., None] >> shifts) & (2**bits - 1)  # (..., words, 32 // bits)
    num_groups = scales.shape[-1]
    q = q.reshape(*lead, num_groups, group_size).astype(mx.float32)
    x = q * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return x.reshape(*lead, num_groups * group_size).astype(scales.dtype)
