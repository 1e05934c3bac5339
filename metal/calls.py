"""What each operation is given, declared once: `AttentionCall` (paged attention) and `KVWrite`.

Every path of an operation takes its one object: the backend choice in
`baselm/paged_attention.py` (CPU kernel or not), the dispatch here (Metal kernel or
reference), the reference and the kernel wrappers. So the parameters are listed here only,
and a new one reaches every path at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.kv_quant import Pool


@dataclass(slots=True)
class AttentionCall:
    """One layer's paged attention of a step: the flattened queries over the K/V `meta` describes.

    A pool is (num_blocks, block_size, kv_heads, head_dim), or a `QuantizedPool` of that shape.
    """

    queries: mx.array  # (num_tokens, heads, head_dim)
    key_pool: Pool  # (num_blocks, block_size, kv_heads, head_dim)
    value_pool: Pool  # (num_blocks, block_size, kv_heads, head_dim)
    meta: AttentionMetadata
    scale: float  # multiplies the scores
    softcap: float | None = None  # scores become tanh(s / softcap) * softcap (gemma2)
    window: int | None = None  # a query sees keys at positions > its own - window (sliding window)
    sinks: mx.array | None = None  # (heads,) one learned logit per head: a key with no value (gpt-oss)


@dataclass(slots=True)
class KVWrite:
    """One layer's K/V write of a step: the new rows into the pools at their slots.

    NOTE: a pool is rebound to the write's result; with no other reference alive (drop the
    `KVWrite` with the old pools) MLX donates the old buffer, so the write happens in place.
    """

    key_pool: Pool  # (num_blocks, block_size, kv_heads, head_dim)
    value_pool: Pool  # (num_blocks, block_size, kv_heads, head_dim)
    keys: mx.array  # (num_tokens, kv_heads, head_dim)
    values: mx.array  # (num_tokens, kv_heads, head_dim)
    slot_mapping: mx.array  # (num_tokens,) int32: pool slot of each row (block_id * block_size + offset)
