"""Paged-attention cases shared by the emulated and the real-GPU kernel tests.

Each case is a step of several sequences over random pools; the pools are filled in every
slot, and the block tables name blocks out of order, so reading a wrong block shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kv_quant import allocate_pool
from baselm.metal.reference import write_kv_reference


@dataclass(frozen=True)
class Case:
    name: str
    dtype: mx.Dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int = 16
    kv_bits: int = 16
    softcap: float | None = None
    window: int | None = None
    num_splits: int | None = 1
    sinks: bool = False  # a sink logit per head (gpt-oss)

    def sink_logits(self) -> mx.array | None:
        """(num_heads,) float32 sink logits spread around the scores' range, or None."""
        return mx.linspace(-2.0, 3.0, self.num_heads) if self.sinks else None


F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16
CASES = [
    Case("decode_only_mha_d64", F32, 64, 4, 4, (1, 1, 1), (5, 17, 33)),
    Case("prefill_only_gqa_d128", F16, 128, 4, 2, (9, 20), (9, 20)),
    Case("mixed_gqa3_d80_bs8", BF16, 80, 6, 2, (1, 5, 7), (30, 12, 7), block_size=8),
    Case("mixed_mqa_d96", F32, 96, 4, 1, (1, 4), (19, 6)),
    Case("mqa_8_heads_in_two_threadgroups", F16, 64, 8, 1, (1, 4), (26, 9)),
    Case("gqa_7_heads_per_kv_head", F32, 64, 14, 2, (2, 1), (11, 17)),
    Case("mixed_gqa_d256", F16, 256, 2, 1, (1, 3), (21, 3)),
    Case("q8_pool_gqa_d128", F16, 128, 4, 2, (1, 6), (25, 11), kv_bits=8),
    Case("q4_pool_d80_group16", F32, 80, 2, 2, (1, 4), (18, 9), kv_bits=4),
    Case("sliding_window", F16, 64, 4, 2, (1, 6), (40, 14), window=6),
    Case("softcap", F32, 64, 2, 1, (1, 5), (23, 5), softcap=5.0),
    Case("split_k_decode", F32, 128, 2, 1, (1, 1), (70, 45), num_splits=3),
    Case("split_k_mixed_empty_splits", BF16, 64, 4, 2, (1, 6), (50, 6), num_splits=4),
    Case("split_k_q4_window_softcap", F16, 64, 2, 2, (2, 1), (37, 60), kv_bits=4, window=20, softcap=8.0, num_splits=2),
    Case("split_k_q8_bf16_d96", BF16, 96, 4, 2, (1, 3), (300, 41), kv_bits=8, num_splits=5),
    Case("q4_pool_d256", F16, 256, 2, 1, (1, 2), (35, 18), kv_bits=4),
    Case("eight_simdgroups_long_prefill_tail", F16, 64, 2, 1, (1, 3), (600, 520)),
    Case("auto_split_long_decode", F32, 64, 2, 2, (1,), (1100,), num_splits=None),
    Case("sinks_gqa_window", F32, 64, 4, 2, (1, 6), (40, 14), window=6, sinks=True),
    Case("sinks_gpt_oss_heads_bf16", BF16, 64, 8, 1, (9, 1), (9, 30), sinks=True),
    Case("split_k_sinks_q8", F16, 64, 4, 2, (2, 1), (37, 60), kv_bits=8, num_splits=3, sinks=True),
    Case("split_k_sinks_empty_splits", F32, 128, 2, 1, (1, 6), (50, 6), num_splits=4, sinks=True),
]


def case_named(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


TOLERANCE = {F32: 2e-5, F16: 3e-3, BF16: 2e-2}


def build(case: Case) -> tuple[mx.array, object, object, AttentionMetadata]:
    """(queries, key_pool, value_pool, meta) for a case, with blocks handed out in reverse order."""
    counts = [-(-c // case.block_size) for c in case.context_lens]
    num_blocks = sum(counts) + 1  # one block no sequence owns
    ids = list(range(num_blocks - 1, 0, -1))
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    meta = AttentionMetadata.build(tables, list(case.query_lens), list(case.context_lens), case.block_size)
    num_slots = num_blocks * case.block_size
    keys = 2 * mx.random.normal((num_slots, case.num_kv_heads, case.head_dim), key=mx.random.key(1))
    values = mx.random.normal((num_slots, case.num_kv_heads, case.head_dim), key=mx.random.key(2))
    pool = allocate_pool(num_blocks, case.block_size, case.num_kv_heads, case.head_dim, case.dtype, case.kv_bits)
    slots = mx.arange(num_slots, dtype=mx.int32)
    key_pool, value_pool = write_kv_reference(
        KVWrite(pool, pool, keys.astype(case.dtype), values.astype(case.dtype), slots)
    )
    queries = mx.random.normal((meta.num_tokens, case.num_heads, case.head_dim), key=mx.random.key(3))
    return queries.astype(case.dtype), key_pool, value_pool, meta


def call_of(case: Case) -> AttentionCall:
    """The case's whole attention call: its step (`build`), scale 1/sqrt(head_dim), softcap, window and sinks."""
    queries, key_pool, value_pool, meta = build(case)
    scale = case.head_dim**-0.5
    return AttentionCall(queries, key_pool, value_pool, meta, scale, case.softcap, case.window, case.sink_logits())


def max_error(got: mx.array, expected: mx.array) -> float:
    return mx.max(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32))).item()
