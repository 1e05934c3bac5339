"""The CPU paged-attention kernel against the pure-MLX reference, and which path serves a call.

Each case is one step of several sequences over pools filled in every slot, their block
tables naming shuffled blocks of different counts, so reading a wrong block, row or head
shows. Cases mix decode rows with prompt chunks, put positions on block boundaries, and
cover head_dim 64/80/128/256, GQA ratios 1-8, MQA, windows, soft-capping, and q8/q4 pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu, paged_attention
from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kv_quant import allocate_pool
from baselm.metal.reference import paged_attention_reference, write_kv_reference
from tests.cpu.conftest import requires_kernels


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int = 16
    dtype: mx.Dtype = mx.float32
    kv_bits: int = 16
    softcap: float | None = None
    window: int | None = None


F16, BF16 = mx.float16, mx.bfloat16
CASES = [
    Case("one_decode_one_key", 64, 9, 3, (1,), (1,)),
    Case("decodes_at_block_boundaries", 64, 9, 3, (1, 1, 1, 1), (15, 16, 17, 32)),
    Case("prompt_chunk_alone", 64, 9, 3, (37,), (37,)),
    Case("chunk_over_cached_blocks", 64, 9, 3, (64,), (400,)),
    Case("mixed_decodes_and_chunks", 64, 9, 3, (1, 1, 64, 3, 1), (300, 17, 1000, 20, 48)),
    Case("mha_d128_bs8", 128, 4, 4, (5, 1), (40, 33), block_size=8),
    Case("mqa_8_heads_d128", 128, 8, 1, (1, 7), (26, 9)),
    Case("gqa_7_d80_bs5", 80, 14, 2, (2, 1, 9), (11, 17, 9), block_size=5),
    Case("d256_long_tail", 256, 2, 1, (1, 3), (21, 130)),
    Case("softcap", 64, 4, 2, (1, 20), (23, 100), softcap=5.0),
    Case("window_inside_a_chunk", 64, 4, 2, (1, 40), (40, 60), window=7),
    Case("window_and_softcap", 64, 9, 3, (20, 1), (100, 50), window=32, softcap=30.0),
    Case("q8_pool", 64, 9, 3, (1, 20), (100, 50), kv_bits=8),
    Case("q4_pool_d80_group16", 80, 2, 2, (1, 4), (18, 9), kv_bits=4),
    Case("q4_window_softcap", 64, 2, 2, (2, 1), (37, 60), kv_bits=4, window=20, softcap=8.0),
    Case("float16_pool", 64, 4, 2, (1, 6), (40, 14), dtype=F16),
    Case("bfloat16_q8_pool", 96, 4, 2, (1, 3), (300, 41), dtype=BF16, kv_bits=8),
]
# The reference rounds its probabilities and output to the pool dtype; the kernel keeps float32.
TOLERANCE = {mx.float32: 2e-5, F16: 2e-3, BF16: 1.5e-2}


def build(case: Case, seed: int = 0) -> tuple[mx.array, object, object, AttentionMetadata]:
    """(queries, key_pool, value_pool, meta) of a case; every slot of the pools holds a random row."""
    rng = np.random.default_rng(seed)
    counts = [-(-c // case.block_size) + 1 for c in case.context_lens]  # one spare block each: ragged tables
    num_blocks = sum(counts) + 1
    ids = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    meta = AttentionMetadata.build(tables, list(case.query_lens), list(case.context_lens), case.block_size)
    num_slots = num_blocks * case.block_size
    shape = (num_slots, case.num_kv_heads, case.head_dim)
    keys = mx.array(2 * rng.standard_normal(shape).astype(np.float32)).astype(case.dtype)
    values = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(case.dtype)
    pool = allocate_pool(num_blocks, case.block_size, case.num_kv_heads, case.head_dim, case.dtype, case.kv_bits)
    key_pool, value_pool = write_kv_reference(KVWrite(pool, pool, keys, values, mx.arange(num_slots, dtype=mx.int32)))
    queries = mx.array(rng.standard_normal((meta.num_tokens, case.num_heads, case.head_dim)).astype(np.float32))
    return queries, key_pool, value_pool, meta


def max_error(case: Case) -> float:
    call = AttentionCall(*build(case), case.head_dim**-0.5, case.softcap, case.window)
    expected = paged_attention_reference(call)
    got = paged_attention.paged_attention(call)
    assert got.shape == expected.shape and got.dtype == mx.float32
    return float(mx.abs(got - expected.astype(mx.float32)).max())


@requires_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_the_reference(case):
    assert paged_attention.kernel_applies(*build(case)[:2])
    assert max_error(case) < TOLERANCE[case.dtype]


def test_every_instruction_set_matches_the_reference(kernels):
    assert kernels.attention_isa() == kernels.isa()
    for name in ("mixed_decodes_and_chunks", "q4_window_softcap", "bfloat16_q8_pool", "gqa_7_d80_bs5", "softcap"):
        case = next(c for c in CASES if c.name == name)
        assert max_error(case) < TOLERANCE[case.dtype], name


@requires_kernels
def test_a_long_step_split_over_threads_matches_one_tile_at_a_time():
    # Big enough to run on the thread pool: the tiles must not share scratch.
    case = Case("long", 64, 9, 3, (64, 1, 1, 64), (2000, 700, 5, 64))
    assert max_error(case) < TOLERANCE[mx.float32]


@requires_kernels
def test_head_dim_off_the_vector_width_goes_to_the_reference():
    case = Case("d72", 72, 4, 2, (1, 3), (20, 9))
    queries, key_pool, value_pool, meta = build(case)
    assert not paged_attention.kernel_applies(queries, key_pool)
    call = AttentionCall(queries, key_pool, value_pool, meta, 0.1)
    assert mx.array_equal(paged_attention.paged_attention(call), paged_attention_reference(call))


def test_without_the_module_every_call_goes_to_the_reference(monkeypatch):
    monkeypatch.setattr(cpu, "kernels", None)
    queries, key_pool, value_pool, meta = build(CASES[4])
    assert not paged_attention.kernel_applies(queries, key_pool)
    call = AttentionCall(queries, key_pool, value_pool, meta, 0.125)
    assert mx.array_equal(paged_attention.paged_attention(call), paged_attention_reference(call))
    assert paged_attention.attention_kernel_status()["cpu paged_attention"] != "used"


@requires_kernels
def test_bad_inputs_are_refused_with_a_reason():
    queries, key_pool, value_pool, meta = build(CASES[1])
    starts = mx.array([0, 1, 2, 3, 4], dtype=mx.int32)
    args = (meta.block_tables, meta.context_lens, starts, 16, 0.1, None, None)
    with pytest.raises(ValueError, match="float32"):
        cpu.kernels.paged_attention(queries.astype(mx.float16), [key_pool], [value_pool], *args, 0, 0)
    with pytest.raises(ValueError, match="codes, scales and biases"):
        cpu.kernels.paged_attention(queries, [key_pool], [value_pool], *args, 8, 32)
    with pytest.raises(ValueError, match="num_seqs"):
        cpu.kernels.paged_attention(queries, [key_pool], [value_pool], *args[:2], starts[:3], *args[3:], 0, 0)


@requires_kernels
def test_status_names_the_instruction_set_in_use():
    assert paged_attention.attention_kernel_status() == {"cpu paged_attention": f"used ({cpu.kernels.isa()})"}


@requires_kernels
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kv_write_matches_the_reference_scatter(dtype):
    rng = np.random.default_rng(5)
    pools = [allocate_pool(6, 4, 3, 32, dtype) + mx.array(rng.standard_normal((6, 4, 3, 32)), dtype) for _ in "kv"]
    rows = [mx.array(rng.standard_normal((5, 3, 32)), dtype) for _ in "kv"]
    slots = mx.array([23, 0, 4, 3, 12], dtype=mx.int32)  # both ends of the pool, out of order
    before = [mx.array(np.array(p.astype(mx.float32))) for p in pools]
    expected = write_kv_reference(KVWrite(*pools, *rows, slots))
    written = paged_attention.write_kv(KVWrite(*pools, *rows, slots))
    assert all(mx.array_equal(a, b).item() for a, b in zip(written, expected))
    # the pools were still referenced here, so they were copied, not written over
    assert all(mx.array_equal(p, b).item() for p, b in zip(pools, before))


def test_quantized_pools_are_written_by_the_reference():
    pools = [allocate_pool(2, 4, 1, 32, mx.float32, kv_bits=8) for _ in "kv"]
    rows = mx.ones((1, 1, 32))
    slots = mx.array([5], dtype=mx.int32)
    written = paged_attention.write_kv(KVWrite(*pools, rows, rows, slots))
    expected = write_kv_reference(KVWrite(*pools, rows, rows, slots))
    assert all(mx.array_equal(a, b).item() for a, b in zip(written[0][:3], expected[0][:3]))
