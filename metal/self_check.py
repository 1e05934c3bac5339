"""First-use checks of the Metal kernels against the references, on small cases of the same variant."""

from __future__ import annotations

import mlx.core as mx

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kernels import paged_attention_kernel, quantize_rows_kernel
from baselm.metal.kv_quant import Pool, QuantizedPool, allocate_pool, dequantize_rows, quantize_rows
from baselm.metal.launch import Runner, run_on_metal
from baselm.metal.reference import paged_attention_reference, write_kv_reference

# Two sequences (contexts 21 and 7) over block tables that name the pool's blocks in
# reverse order; run as a decode-only step and as a step with a 3-token prefill chunk,
# so both compiled variants (one query token per threadgroup, or a tile) are checked.
_CONTEXT_LENS = [21, 7]
_STEPS = ([1, 1], [1, 3])


def check_attention(call: AttentionCall, run: Runner = run_on_metal) -> None:
    """Raises if the attention kernel (single pass and split, decode and prefill) disagrees with the
    reference on small cases of `call`'s variant (its dtypes, head shapes, pool, softcap, window, sinks)."""
    queries, key_pool = call.queries, call.key_pool
    num_heads, head_dim = queries.shape[1:]
    sinks = None if call.sinks is None else mx.linspace(-2.0, 3.0, num_heads)  # (heads,)
    block_size, num_kv_heads = key_pool.shape[1:3]
    bits = key_pool.bits if isinstance(key_pool, QuantizedPool) else 16
    counts = [-(-c // block_size) for c in _CONTEXT_LENS]
    ids = list(reversed(range(sum(counts))))
    tables = [ids[: counts[0]], ids[counts[0] :]]
    pools = [_random_pool(key_pool.dtype, sum(counts), block_size, num_kv_heads, head_dim, bits, s) for s in (1, 2)]
    for query_lens in _STEPS:
        meta = AttentionMetadata.build(tables, query_lens, _CONTEXT_LENS, block_size)
        q = mx.random.normal((meta.num_tokens, num_heads, head_dim), key=mx.random.key(3)).astype(queries.dtype)
        case = AttentionCall(q, *pools, meta, head_dim**-0.5, call.softcap, call.window, sinks)
        expected = paged_attention_reference(case)
        for splits in (1, 3):
            got = paged_attention_kernel(case, num_splits=splits, run=run)
            _assert_close(got, expected, f"paged_attention ({query_lens} query tokens, {splits} key split(s))")


def check_write_kv(write: KVWrite, run: Runner = run_on_metal) -> None:
    """Raises if the quantize-on-write kernel disagrees with kv_quant.quantize_rows on rows like `write`'s."""
    keys, key_pool = write.keys, write.key_pool
    rows = mx.random.normal((5, *keys.shape[1:]), key=mx.random.key(4)).astype(keys.dtype)
    args = (key_pool.bits, key_pool.group_size, key_pool.dtype)
    got = dequantize_rows(*quantize_rows_kernel(rows, *args, run=run), key_pool.bits, key_pool.group_size)
    expected = dequantize_rows(*quantize_rows(rows, *args), key_pool.bits, key_pool.group_size)
    _assert_close(got, expected, "KV quantization")


def _random_pool(
    dtype: mx.Dtype, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, bits: int, seed: int
) -> Pool:
    """A pool with random rows in every slot."""
    rows = mx.random.normal((num_blocks * block_size, num_kv_heads, head_dim), key=mx.random.key(seed)).astype(dtype)
    pool = allocate_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, bits)
    slots = mx.arange(num_blocks * block_size, dtype=mx.int32)
    return write_kv_reference(KVWrite(pool, pool, rows, rows, slots))[0]


def _assert_close(got: mx.array, expected: mx.array, what: str) -> None:
    tolerance = 1e-4 if expected.dtype == mx.float32 else 2e-2
    error = mx.max(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32))).item()
    if not error <= tolerance:  # also catches NaN
        raise AssertionError(f"{what} differs from the reference by {error:g} (tolerance {tolerance:g})")
