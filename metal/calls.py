"""What each operation is given, declared once: `AttentionCall` (paged attention) and `KVWrite`.

Every path of an operation takes its one object: the backend choice in
`baselm/paged_attention.py` (CPU kernel or not), the dispatch here (Metal kernel or
reference), the reference and the kernel wrappers. So the parameters are listed here only,
and a new one reaches every path at once.

`check()` holds a call to the shapes the kernels index by (pools that match each other and
the metadata's block size, rows that match the pools): a kernel wrapper calls it before it
launches, since a Metal kernel given other shapes reads and writes past its buffers. It reads
shapes only, never an array's contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.kv_quant import Pool, QuantizedPool


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

    def check(self) -> None:
        """Raises ValueError unless the queries, both pools and the metadata fit together."""
        if self.queries.ndim != 3:
            raise ValueError(
                f"paged attention: queries must be (num_tokens, heads, head_dim), not {self.queries.shape}"
            )
        num_tokens, num_heads, head_dim = self.queries.shape
        check_pools(self.key_pool, self.value_pool, "paged attention")
        _, block_size, num_kv_heads, pool_head_dim = self.key_pool.shape
        if pool_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(
                f"paged attention: queries of {num_heads} heads of {head_dim} over pools of {num_kv_heads} KV heads "
                f"of {pool_head_dim}: head_dim must match and heads be a multiple of kv_heads"
            )
        meta = self.meta
        if block_size != meta.block_size or meta.block_tables.ndim != 2 or meta.block_tables.shape[0] != meta.num_seqs:
            raise ValueError(
                f"paged attention: the metadata's blocks of {meta.block_size} and tables {meta.block_tables.shape} "
                f"for {meta.num_seqs} sequences do not fit pools of blocks of {block_size}"
            )
        if num_tokens != meta.num_tokens:
            raise ValueError(f"paged attention: {num_tokens} query rows for a step of {meta.num_tokens} tokens")
        if self.sinks is not None and self.sinks.shape != (num_heads,):
            raise ValueError(f"paged attention: sinks must be (heads,) = ({num_heads},), not {self.sinks.shape}")


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

    def check(self) -> None:
        """Raises ValueError unless the rows and slots fit the pools."""
        check_pools(self.key_pool, self.value_pool, "KV write")
        row_shape = tuple(self.key_pool.shape[2:])  # (kv_heads, head_dim)
        for name, rows in (("keys", self.keys), ("values", self.values)):
            if rows.ndim != 3 or tuple(rows.shape[1:]) != row_shape:
                raise ValueError(
                    f"KV write: {name} must be (num_tokens, {row_shape[0]}, {row_shape[1]}), not {rows.shape}"
                )
        slots = self.slot_mapping
        if self.keys.shape != self.values.shape or slots.dtype != mx.int32 or slots.shape != self.keys.shape[:1]:
            raise ValueError(
                f"KV write: keys {self.keys.shape}, values {self.values.shape} and an int32 slot_mapping of "
                f"(num_tokens,) must agree, not {slots.dtype} {slots.shape}"
            )


def check_pools(key_pool: Pool, value_pool: Pool, what: str) -> None:
    """Raises ValueError unless the K and V pools are one kind, shape and dtype, each 4-D with at
    least one block, row and KV head, and a quantized one's parts agree with each other."""
    for pool in (key_pool, value_pool):
        if len(pool.shape) != 4 or min(pool.shape) < 1:
            raise ValueError(f"{what}: a pool must be (num_blocks, block_size, kv_heads, head_dim), not {pool.shape}")
        if isinstance(pool, QuantizedPool):
            _check_quantized(pool, what)
    same = type(key_pool) is type(value_pool) and key_pool.shape == value_pool.shape
    same = same and key_pool.dtype == value_pool.dtype
    if isinstance(key_pool, QuantizedPool) and same:
        same = (key_pool.bits, key_pool.group_size) == (value_pool.bits, value_pool.group_size)
    if not same:
        raise ValueError(f"{what}: the key and value pools must have one kind, shape and dtype")


def _check_quantized(pool: QuantizedPool, what: str) -> None:
    groups = pool.head_dim // pool.group_size if pool.group_size > 0 else 0
    lead = pool.codes.shape[:3]
    if pool.bits not in (4, 8) or pool.codes.dtype != mx.uint32 or groups * pool.group_size != pool.head_dim:
        raise ValueError(f"{what}: a quantized pool has uint32 codes of 4 or 8 bits and groups that divide head_dim")
    for part in (pool.scales, pool.biases):
        if part.shape != (*lead, groups) or part.dtype != pool.scales.dtype:
            raise ValueError(f"{what}: a quantized pool's scales and biases must be {(*lead, groups)} of one dtype")
