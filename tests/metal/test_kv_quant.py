"""The quantized KV pool contract and the pure-MLX references that read and write it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kv_quant import QuantizedPool, allocate_pool, dequantize_rows, kv_group_size, quantize_rows
from baselm.metal.reference import paged_attention_reference, write_kv_reference


def test_float_pool_is_a_plain_array():
    pool = allocate_pool(5, 16, 2, 64, mx.float16, 16)
    assert isinstance(pool, mx.array) and pool.shape == (5, 16, 2, 64) and pool.dtype == mx.float16


@pytest.mark.parametrize(
    ("head_dim", "bits", "words", "groups"), [(64, 8, 16, 2), (64, 4, 8, 2), (80, 4, 10, 5), (256, 8, 64, 8)]
)
def test_quantized_pool_layout(head_dim, bits, words, groups):
    pool = allocate_pool(5, 16, 2, head_dim, mx.bfloat16, bits)
    assert isinstance(pool, QuantizedPool)
    assert pool.codes.shape == (5, 16, 2, words) and pool.codes.dtype == mx.uint32
    assert pool.scales.shape == pool.biases.shape == (5, 16, 2, groups)
    assert pool.scales.dtype == pool.biases.dtype == pool.dtype == mx.bfloat16
    assert pool.shape == (5, 16, 2, head_dim) and pool.head_dim == head_dim and pool.bits == bits
    assert pool.nbytes == 5 * 16 * 2 * (4 * words + 2 * 2 * groups)


def test_group_size_is_32_or_16_along_head_dim():
    assert [kv_group_size(d) for d in (64, 80, 96, 128, 256)] == [32, 16, 32, 32, 32]
    with pytest.raises(ValueError, match="head_dim divisible by 16, got 72"):
        kv_group_size(72)


def test_unsupported_kv_bits_is_refused():
    with pytest.raises(ValueError, match=r"kv_bits must be one of \(16, 8, 4\), got 3"):
        allocate_pool(1, 16, 1, 64, mx.float16, 3)


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_use_mlx_affine_packing(bits):
    rows = mx.random.normal((6, 2, 128), key=mx.random.key(0))
    codes, scales, biases = quantize_rows(rows, bits, 32, mx.float32)
    ours = dequantize_rows(codes, scales, biases, bits, 32)
    mlx = mx.dequantize(codes.reshape(12, -1), scales.reshape(12, -1), biases.reshape(12, -1), group_size=32, bits=bits)
    assert mx.array_equal(ours, mlx.reshape(6, 2, 128))


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_at_most_half_a_step(bits):
    rows = 3 * mx.random.normal((6, 2, 80), key=mx.random.key(1))
    codes, scales, biases = quantize_rows(rows, bits, 16, mx.float32)
    error = mx.abs(dequantize_rows(codes, scales, biases, bits, 16) - rows)
    half_step = mx.repeat(scales, 16, axis=-1) / 2
    assert mx.all(error <= half_step * (1 + 1e-5) + 1e-6).item()


def test_constant_group_quantizes_exactly():
    rows = mx.full((1, 1, 64), 0.75)
    codes, scales, biases = quantize_rows(rows, 4, 32, mx.float16)
    assert mx.array_equal(dequantize_rows(codes, scales, biases, 4, 32), rows.astype(mx.float16))


def test_write_kv_reference_quantizes_into_the_given_slots_only():
    pool = allocate_pool(2, 4, 1, 64, mx.float32, 8)
    keys = mx.random.normal((2, 1, 64), key=mx.random.key(2))
    key_pool, _ = write_kv_reference(KVWrite(pool, pool, keys, keys, mx.array([6, 1], dtype=mx.int32)))
    flat = [a.reshape(8, 1, -1) for a in key_pool[:3]]
    stored = dequantize_rows(*(a[mx.array([6, 1])] for a in flat), 8, 32)
    assert mx.array_equal(stored, dequantize_rows(*quantize_rows(keys, 8, 32, mx.float32), 8, 32))
    untouched = mx.array([0, 2, 3, 4, 5, 7])
    assert all(mx.all(a[untouched] == 0).item() for a in flat)


def quantized_attention_error(bits: int, head_dim: int, seed: int) -> float:
    meta = AttentionMetadata.build([[3, 1], [0, 2]], [1, 8], [29, 20], 16)
    keys = mx.random.normal((64, 2, head_dim), key=mx.random.key(seed))
    values = mx.random.normal((64, 2, head_dim), key=mx.random.key(seed + 10))
    queries = mx.random.normal((9, 4, head_dim), key=mx.random.key(seed + 20))
    slots = mx.arange(64, dtype=mx.int32)
    outputs = []
    for kv_bits in (16, bits):
        pool = allocate_pool(4, 16, 2, head_dim, mx.float32, kv_bits)
        key_pool, value_pool = write_kv_reference(KVWrite(pool, pool, keys, values, slots))
        outputs.append(paged_attention_reference(AttentionCall(queries, key_pool, value_pool, meta, head_dim**-0.5)))
    return mx.max(mx.abs(outputs[0] - outputs[1])).item()


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_quantized_attention_stays_close_to_float_attention(head_dim):
    # Unit-normal K, V and queries: q8 within 0.02 and q4 within 0.3 of float attention (max abs).
    assert quantized_attention_error(8, head_dim, seed=0) <= 0.02
    assert quantized_attention_error(4, head_dim, seed=0) <= 0.3
