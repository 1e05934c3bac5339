"""The Metal kernels on a real Apple GPU, against the MLX references (skipped elsewhere)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from metal_cases import CASES, TOLERANCE, Case, build, call_of, case_named, max_error

from baselm.metal import AttentionCall, KVWrite, dispatch, kernel_status, paged_attention, write_kv
from baselm.metal.kernels import num_key_splits, paged_attention_kernel, quantize_rows_kernel, write_kv_kernel
from baselm.metal.kv_quant import allocate_pool, dequantize_rows, quantize_rows
from baselm.metal.reference import paged_attention_reference, write_kv_reference

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (Metal)"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(case: Case):
    call = call_of(case)
    got = paged_attention_kernel(call, num_splits=case.num_splits)
    with mx.stream(mx.cpu):
        expected = paged_attention_reference(call)
    assert max_error(got, expected) <= TOLERANCE[case.dtype]


def test_long_decode_takes_the_split_path_and_matches_reference():
    case = Case("long_decode", mx.float16, 128, 8, 2, (1, 1), (3000, 1500), num_splits=None)
    call = call_of(case)
    meta = call.meta
    assert num_key_splits(meta.num_tokens, case.num_kv_heads, meta.max_context_len) > 1
    assert max_error(paged_attention_kernel(call), paged_attention_reference(call)) <= TOLERANCE[mx.float16]


@pytest.mark.parametrize(("dtype", "head_dim", "bits"), [(mx.float16, 128, 8), (mx.bfloat16, 80, 4)])
def test_quantize_kernel_is_within_one_step_of_the_reference(dtype, head_dim, bits):
    rows = (3 * mx.random.normal((5, 2, head_dim), key=mx.random.key(7))).astype(dtype)
    group = 16 if head_dim == 80 else 32
    got = dequantize_rows(*quantize_rows_kernel(rows, bits, group, dtype), bits, group).astype(mx.float32)
    codes, scales, biases = quantize_rows(rows, bits, group, dtype)
    expected = dequantize_rows(codes, scales, biases, bits, group).astype(mx.float32)
    step = mx.repeat(scales.astype(mx.float32), group, axis=-1)
    assert mx.all(mx.abs(got - expected) <= step * 1.01 + 1e-3).item()


def test_write_kv_kernel_matches_reference():
    pool = allocate_pool(3, 8, 2, 64, mx.float16, 8)
    keys = mx.random.normal((4, 2, 64), key=mx.random.key(8)).astype(mx.float16)
    slots = mx.array([17, 3, 8, 23], dtype=mx.int32)
    got, _ = write_kv_kernel(KVWrite(pool, pool, keys, keys, slots))
    expected, _ = write_kv_reference(KVWrite(pool, pool, keys, keys, slots))
    assert max_error(dequantize_rows(*got[:3], 8, 32), dequantize_rows(*expected[:3], 8, 32)) <= 0.02


def test_public_functions_use_the_kernels_after_their_self_check(monkeypatch):
    monkeypatch.delenv("BASE_KERNELS", raising=False)
    case = case_named("q8_pool_gqa_d128")
    queries, key_pool, value_pool, meta = build(case)
    rows = mx.zeros((meta.num_tokens, 2, 128), mx.float16)
    key_pool, value_pool = write_kv(KVWrite(key_pool, value_pool, rows, rows, meta.slot_mapping))
    paged_attention(AttentionCall(queries, key_pool, value_pool, meta, case.head_dim**-0.5))
    assert kernel_status() == {"paged_attention": "used", "write_kv": "used"}


def test_base_kernels_0_disables_them(monkeypatch):
    monkeypatch.setattr(dispatch, "_failures", {})
    monkeypatch.setenv("BASE_KERNELS", "0")
    assert dispatch.use_kernel("paged_attention", "any", lambda: None) is False
    assert kernel_status() == {"paged_attention": "disabled", "write_kv": "disabled"}
