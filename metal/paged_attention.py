"""Paged attention over block pools, and KV writes into pool slots (pure-MLX references).

Pools are (num_blocks, block_size, kv_heads, head_dim). A sequence's keys are the rows of
the blocks its block table names, in order. The metadata object (duck-typed here, so this
package imports nothing from the engine) supplies `slot_mapping`, `block_tables`,
`context_lens`, `query_pos`, `query_rows`, `token_rows`, `block_size`, `num_seqs`,
`max_query_len` and `max_context_len`.
"""

from __future__ import annotations

import math

import mlx.core as mx


def write_kv_reference(
    key_pool: mx.array, value_pool: mx.array, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatters `keys`/`values` (num_tokens, kv_heads, head_dim) into the pools at `slot_mapping`."""
    shape = key_pool.shape
    flat_k = key_pool.reshape(-1, shape[2], shape[3])  # (num_slots, kv_heads, head_dim)
    flat_v = value_pool.reshape(-1, shape[2], shape[3])
    flat_k[slot_mapping] = keys.astype(flat_k.dtype)
    flat_v[slot_mapping] = values.astype(flat_v.dtype)
    return flat_k.reshape(shape), flat_v.reshape(shape)


def _gather_sequences(pool: mx.array, meta) -> mx.array:
    """Each sequence's cached rows, (num_seqs, kv_heads, num_blocks_used * block_size, head_dim)."""
    num_blocks_used = math.ceil(meta.max_context_len / meta.block_size)
    tables = meta.block_tables[:, :num_blocks_used]  # (num_seqs, num_blocks_used)
    rows = pool[tables]  # (num_seqs, num_blocks_used, block_size, kv_heads, head_dim)
    num_seqs = rows.shape[0]
    return rows.reshape(num_seqs, -1, pool.shape[2], pool.shape[3]).transpose(0, 2, 1, 3)


def _attention_mask(meta, num_keys: int, window: int | None) -> mx.array:
    """(num_seqs, 1, max_query_len, num_keys) bool: causal, inside the context, inside the window."""
    key_pos = mx.arange(num_keys)  # (num_keys,)
    query_pos = meta.query_pos[:, :, None]  # (num_seqs, max_query_len, 1)
    mask = (key_pos <= query_pos) & (key_pos < meta.context_lens[:, None, None])
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask[:, None]


def _softcapped_attention(q, k, v, scale: float, mask: mx.array, softcap: float) -> mx.array:
    """Attention with tanh soft-capping of the scores (Gemma 2), GQA by grouping query heads."""
    num_seqs, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, num_queries, head_dim)
    scores = (q * scale) @ k[:, :, None].swapaxes(-1, -2)  # (S, kv_heads, group, Q, L)
    scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(mask[:, :, None], scores, mx.array(-float("inf"), scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(v.dtype)
    out = probs @ v[:, :, None]  # (S, kv_heads, group, Q, head_dim)
    return out.reshape(num_seqs, num_heads, num_queries, -1)


def paged_attention_reference(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> mx.array:
    """Attention of the flattened `queries` (num_tokens, heads, head_dim) over paged K/V.

    Gathers every sequence's blocks into a dense tensor (the copy the Metal kernel avoids),
    pads queries to the longest query of the step, and attends with a causal mask.
    Returns (num_tokens, heads, head_dim).
    """
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    keys = _gather_sequences(key_pool, meta)  # (S, kv_heads, L, head_dim)
    values = _gather_sequences(value_pool, meta)
    q = queries[meta.query_rows].reshape(meta.num_seqs, meta.max_query_len, num_heads, head_dim)
    q = q.transpose(0, 2, 1, 3)  # (S, heads, max_query_len, head_dim)
    mask = _attention_mask(meta, keys.shape[2], window)
    if softcap is None:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    else:
        out = _softcapped_attention(q, keys, values, scale, mask, softcap)
    out = out.transpose(0, 2, 1, 3).reshape(-1, num_heads, out.shape[-1])  # (S * max_query_len, heads, head_dim)
    return out[meta.token_rows]


# The engine calls these; backends with a custom kernel route to it here.
write_kv = write_kv_reference
paged_attention = paged_attention_reference
