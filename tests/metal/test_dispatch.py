"""Which path serves a call off Metal, and the launch-shape choices of the kernel wrappers."""

from __future__ import annotations

import mlx.core as mx
import pytest
from metal_cases import build, case_named

from baselm.metal import (
    AttentionCall,
    KVWrite,
    kernel_status,
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)
from baselm.metal.dispatch import on_metal
from baselm.metal.kernels import (
    heads_per_threadgroup,
    num_key_splits,
    num_simdgroups,
    query_tiles,
    tokens_per_threadgroup,
)

off_metal = pytest.mark.skipif(on_metal(), reason="checks the behaviour off Metal")


@off_metal
def test_kernels_are_reported_unavailable_off_metal():
    assert kernel_status() == {
        "paged_attention": "not available on this backend",
        "write_kv": "not available on this backend",
    }


@off_metal
def test_public_functions_are_the_references_off_metal():
    queries, key_pool, value_pool, meta = build(case_named("q8_pool_gqa_d128"))
    rows = mx.ones((meta.num_tokens, 2, 128), dtype=mx.float16)
    written = write_kv(KVWrite(key_pool, value_pool, rows, rows, meta.slot_mapping))
    expected = write_kv_reference(KVWrite(key_pool, value_pool, rows, rows, meta.slot_mapping))
    assert all(mx.array_equal(a, b) for a, b in zip(written[0][:3], expected[0][:3]))
    got = paged_attention(AttentionCall(queries, *written, meta, 0.1))
    assert mx.array_equal(got, paged_attention_reference(AttentionCall(queries, *expected, meta, 0.1)))
    assert kernel_status()["paged_attention"] == "not available on this backend"


def test_keys_are_split_only_for_few_queries_over_long_contexts():
    assert num_key_splits(num_tokens=1, num_head_groups=8, max_context_len=1000) == 1
    assert num_key_splits(num_tokens=1, num_head_groups=8, max_context_len=4096) == 8
    assert num_key_splits(num_tokens=4, num_head_groups=32, max_context_len=32768) == 4
    assert num_key_splits(num_tokens=16, num_head_groups=32, max_context_len=32768) == 1
    assert num_key_splits(num_tokens=1, num_head_groups=1, max_context_len=100_000) == 32


def test_long_contexts_get_more_simdgroups_per_threadgroup():
    assert [num_simdgroups(n) for n in (1, 511, 512, 10_000)] == [4, 4, 8, 8]


def test_query_heads_of_a_kv_head_share_a_threadgroup_up_to_four():
    pairs = [(32, 8), (9, 3), (6, 1), (8, 1), (8, 8), (14, 2), (40, 8)]
    assert [heads_per_threadgroup(h, kv) for h, kv in pairs] == [4, 3, 3, 4, 1, 1, 1]


def test_prefill_tokens_share_a_threadgroup_within_a_register_budget():
    assert tokens_per_threadgroup(max_query_len=1, heads_per_group=3, head_dim=64) == 1
    assert tokens_per_threadgroup(max_query_len=9, heads_per_group=3, head_dim=64) == 2
    assert tokens_per_threadgroup(max_query_len=9, heads_per_group=1, head_dim=128) == 8
    assert tokens_per_threadgroup(max_query_len=9, heads_per_group=2, head_dim=256) == 2
    assert tokens_per_threadgroup(max_query_len=9, heads_per_group=8, head_dim=256) == 1


def test_query_tiles_never_cross_a_sequence():
    tiles = query_tiles((1, 6, 3), 4)
    assert tiles.tolist() == [[0, 1], [1, 4], [5, 2], [7, 3]]
