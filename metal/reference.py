"""Pure-MLX references of the KV write and of paged attention: the path on CPU and CUDA, the tests' oracle.

Pools are (num_blocks, block_size, kv_heads, head_dim) float arrays or QuantizedPools of
that logical shape (kv_quant.py). A sequence's keys are the rows of the blocks its block
table names, in order. The Metal kernels (kernels.py) compute the same maths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kv_quant import Pool, QuantizedPool, dequantize_rows, quantize_rows

# (rows (num_tokens, kv_heads, head_dim), bits, group_size, dtype) -> (codes, scales, biases)
Quantizer = Callable[[mx.array, int, int, mx.Dtype], tuple[mx.array, mx.array, mx.array]]


def write_kv_reference(write: KVWrite) -> tuple[Pool, Pool]:
    """The pools with the new keys and values scattered into their slots.

    Quantized pools get the rows quantized first (kv_quant.quantize_rows).
    """
    key_pool = write_pool(write.key_pool, write.keys, write.slot_mapping)
    return key_pool, write_pool(write.value_pool, write.values, write.slot_mapping)


def write_pool(pool: Pool, rows: mx.array, slot_mapping: mx.array, quantize: Quantizer = quantize_rows) -> Pool:
    """`pool` with `rows` (num_tokens, kv_heads, head_dim) at the slots, quantized by `quantize` for a
    quantized pool; in place when the caller holds the only reference to the pool (donation)."""
    if not isinstance(pool, QuantizedPool):
        return _scatter(pool, as_dtype(rows, pool.dtype), slot_mapping)
    parts = quantize(rows, pool.bits, pool.group_size, pool.dtype)
    codes, scales, biases = (_scatter(a, p, slot_mapping) for a, p in zip(pool[:3], parts))
    return QuantizedPool(codes, scales, biases, pool.bits, pool.group_size)


def as_dtype(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """`x` in `dtype`, without a graph node when it already is (CPU decode is dispatch-bound)."""
    return x if x.dtype == dtype else x.astype(dtype)


def _scatter(pool: mx.array, rows: mx.array, slot_mapping: mx.array) -> mx.array:
    """`pool` with `rows` (num_tokens, kv_heads, X) at the slots."""
    shape = pool.shape
    flat = pool.reshape(-1, shape[2], shape[3])  # (num_slots, kv_heads, X)
    flat[slot_mapping] = rows
    return flat.reshape(shape)


def paged_attention_reference(call: AttentionCall) -> mx.array:
    """Attention of the flattened queries (num_tokens, heads, head_dim) over paged K/V.

    Gathers every sequence's blocks into a dense tensor (the copy the Metal kernel avoids),
    dequantizing quantized pools, pads queries to the longest query, and attends with a
    causal mask (keys at positions <= the query's, or <= `meta.attend_until` inside a span of
    tokens that see each other both ways, and, with `window`, > the query's position - window),
    optional tanh soft-capping of the scores and optional attention sinks (heads,): one learned
    logit per head that joins each row's softmax as an extra key with no value, so a query may
    give part of its weight to nothing (gpt-oss).
    A step that mixes decodes with longer query chunks attends in groups (all decodes
    together, each chunk alone), so a long prompt chunk does not pad every decode to its
    length and context. Returns (num_tokens, heads, head_dim).
    """
    meta = call.meta
    if meta.max_query_len == 1 or meta.num_seqs == 1:
        return _attend_padded(call)
    groups = _query_groups(meta)
    outs = [_attend_padded(replace(call, queries=call.queries[g.rows], meta=g.meta)) for g in groups]
    order = np.argsort(np.concatenate([g.rows_host for g in groups]), kind="stable")
    return mx.concatenate(outs)[mx.array(order.astype(np.int32))]  # back to the flattened order


class _QueryGroup(NamedTuple):
    """Some of a step's sequences, attended together."""

    meta: AttentionMetadata  # the step of these sequences alone
    rows: mx.array  # (group tokens,) int32: their rows among the step's flattened tokens
    rows_host: np.ndarray


def _query_groups(meta: AttentionMetadata) -> list[_QueryGroup]:
    """Decoding sequences in one group, every longer query chunk in its own (cached per step)."""
    if "groups" in meta.mask_cache:
        return meta.mask_cache["groups"]
    q_lens = np.asarray(meta.query_lens)
    decodes = np.flatnonzero(q_lens == 1)
    members = ([decodes] if len(decodes) else []) + [np.array([s]) for s in np.flatnonzero(q_lens > 1)]
    groups = []
    for seq_ids in members:
        rows = meta.token_indices(seq_ids)
        groups.append(_QueryGroup(meta.select(seq_ids), mx.array(rows.astype(np.int32)), rows))
    meta.mask_cache["groups"] = groups
    return groups


def _attend_padded(call: AttentionCall) -> mx.array:
    """Attention of all sequences of `call.meta` at once, padded to its longest query and context."""
    queries, meta = call.queries, call.meta
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    keys = _gather_sequences(call.key_pool, meta)  # (S, kv_heads, L, head_dim)
    values = _gather_sequences(call.value_pool, meta)
    decode_only = meta.max_query_len == 1  # one query per sequence: no padding, no reordering
    if meta.num_seqs == 1 and decode_only:
        keys, values = keys[:, :, : meta.max_context_len], values[:, :, : meta.max_context_len]
    if decode_only:
        q = queries[:, :, None, :]  # (S, heads, 1, head_dim)
    else:
        q = queries[meta.query_rows].reshape(meta.num_seqs, meta.max_query_len, num_heads, head_dim)
        q = q.transpose(0, 2, 1, 3)  # (S, heads, max_query_len, head_dim)
    mask = _attention_mask(meta, keys.shape[2], call.window)
    if call.softcap is None and mx.default_device() != mx.cpu:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=call.scale, mask=mask, sinks=call.sinks)
    else:
        out = _grouped_attention(q, keys, values, call.scale, mask, call.softcap, call.sinks)
    if decode_only:
        return out[:, :, 0, :]  # (S, heads, head_dim)
    out = out.transpose(0, 2, 1, 3).reshape(-1, num_heads, out.shape[-1])  # (S * max_query_len, heads, head_dim)
    return out[meta.token_rows]


def _gather_sequences(pool: Pool, meta: AttentionMetadata) -> mx.array:
    """Each sequence's cached rows, (num_seqs, kv_heads, num_blocks_used * block_size, head_dim).

    Quantized pools are dequantized after the gather, to the dtype of their scales.
    """
    num_blocks_used = math.ceil(meta.max_context_len / meta.block_size)
    tables = meta.block_tables[:, :num_blocks_used]  # (num_seqs, num_blocks_used)
    num_seqs = tables.shape[0]

    def gather(a: mx.array) -> mx.array:  # (num_seqs, num_blocks_used * block_size, kv_heads, X)
        return a[tables].reshape(num_seqs, -1, a.shape[2], a.shape[3])

    if isinstance(pool, QuantizedPool):
        rows = dequantize_rows(gather(pool.codes), gather(pool.scales), gather(pool.biases), pool.bits, pool.group_size)
    else:
        rows = gather(pool)
    return rows.transpose(0, 2, 1, 3)


def _attention_mask(meta: AttentionMetadata, num_keys: int, window: int | None) -> mx.array | None:
    """(num_seqs, 1, max_query_len, num_keys) bool: causal, inside the context, inside the window.

    None when nothing needs masking: one sequence decoding one token over exactly its keys.
    Built once per step and window, then shared by every layer through `meta.mask_cache`.
    """
    plain = meta.num_seqs == 1 and meta.max_query_len == 1 and meta.attend_until is None
    if plain and num_keys == meta.max_context_len and window is None:
        return None
    key = (num_keys, window)
    if key in meta.mask_cache:
        return meta.mask_cache[key]
    key_pos = mx.arange(num_keys)  # (num_keys,)
    query_pos = meta.query_pos[:, :, None]  # (num_seqs, max_query_len, 1)
    until = query_pos if meta.attend_until is None else meta.attend_until[:, :, None]
    mask = (key_pos <= until) & (key_pos < meta.context_lens[:, None, None])
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask[:, None]
    meta.mask_cache[key] = mask
    return mask


def _grouped_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | None,
    softcap: float | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention with the query heads of each KV head stacked into one matmul (GQA/MQA).

    q: (S, heads, Q, head_dim); k, v: (S, kv_heads, L, head_dim). One batched matmul per
    KV head, rather than one per query head, is twice as fast as MLX's CPU attention for
    decode steps and as fast for prefill. Optional tanh soft-capping (Gemma 2) of the scores,
    optional sinks (heads,): an extra softmax column per head whose weight is dropped (gpt-oss).
    """
    num_seqs, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q = q.reshape(num_seqs, num_kv_heads, group * num_queries, head_dim)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (S, kv_heads, group * Q, L)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.reshape(num_seqs, num_kv_heads, group, num_queries, -1)
        scores = mx.where(mask[:, :, None], scores, mx.array(-float("inf"), scores.dtype))
        scores = scores.reshape(num_seqs, num_kv_heads, group * num_queries, -1)
    scores = as_dtype(scores, mx.float32)
    if sinks is None:
        probs = mx.softmax(scores, axis=-1, precise=True)
    else:
        sink_col = mx.broadcast_to(  # each query row of head h gets head h's sink logit
            sinks.astype(mx.float32).reshape(1, num_kv_heads, group, 1, 1),
            (num_seqs, num_kv_heads, group, num_queries, 1),
        ).reshape(num_seqs, num_kv_heads, group * num_queries, 1)
        probs = mx.softmax(mx.concatenate([scores, sink_col], axis=-1), axis=-1, precise=True)[..., :-1]
    probs = as_dtype(probs, v.dtype)
    out = probs @ v  # (S, kv_heads, group * Q, head_dim)
    return out.reshape(num_seqs, num_heads, num_queries, -1)
