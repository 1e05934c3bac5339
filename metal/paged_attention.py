"""Paged attention over block pools, and KV writes into pool slots: references, kernels, dispatch.

Pools are (num_blocks, block_size, kv_heads, head_dim) float arrays or QuantizedPools of
that logical shape (kv_quant.py). A sequence's keys are the rows of the blocks its block
table names, in order. The metadata object (duck-typed here, so this package imports
nothing from the engine) supplies `slot_mapping`, `block_tables`, `context_lens`,
`query_pos`, `query_rows`, `token_rows`, `positions`, `block_size`, `query_lens` and
`context_lens_host` (host tuples), `num_seqs`, `num_tokens`, `max_query_len` and
`max_context_len`.

The pure-MLX references are the path on CPU and CUDA and the tests' oracle; the Metal
kernels (paged_attention.metal, paged_attention_reduce.metal, write_kv.metal) compute the
same maths and serve `paged_attention` / `write_kv` on Metal (see README.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from baselm.metal import dispatch, self_check
from baselm.metal.kv_quant import Pool, QuantizedPool, dequantize_rows, quantize_rows
from baselm.metal.launch import KernelSource, Launch, Runner, run_on_metal


def write_kv_reference(
    key_pool: Pool, value_pool: Pool, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[Pool, Pool]:
    """Scatters `keys`/`values` (num_tokens, kv_heads, head_dim) into the pools at `slot_mapping`.

    Quantized pools get the rows quantized first (kv_quant.quantize_rows).
    """
    return _write_pool(key_pool, keys, slot_mapping), _write_pool(value_pool, values, slot_mapping)


def _write_pool(pool: Pool, rows: mx.array, slot_mapping: mx.array) -> Pool:
    if isinstance(pool, QuantizedPool):
        return _scatter_quantized(pool, quantize_rows(rows, pool.bits, pool.group_size, pool.dtype), slot_mapping)
    return _scatter(pool, _as(rows, pool.dtype), slot_mapping)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """`x` in `dtype`, without a graph node when it already is (CPU decode is dispatch-bound)."""
    return x if x.dtype == dtype else x.astype(dtype)


def _scatter(pool: mx.array, rows: mx.array, slot_mapping: mx.array) -> mx.array:
    """`pool` with `rows` (num_tokens, kv_heads, X) at the slots; in place when the pool is donated."""
    shape = pool.shape
    flat = pool.reshape(-1, shape[2], shape[3])  # (num_slots, kv_heads, X)
    flat[slot_mapping] = rows
    return flat.reshape(shape)


def _scatter_quantized(pool: QuantizedPool, parts: tuple[mx.array, mx.array, mx.array], slot_mapping) -> QuantizedPool:
    codes, scales, biases = (_scatter(a, p, slot_mapping) for a, p in zip(pool[:3], parts))
    return QuantizedPool(codes, scales, biases, pool.bits, pool.group_size)


def _gather_sequences(pool: Pool, meta) -> mx.array:
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


def _attention_mask(meta, num_keys: int, window: int | None) -> mx.array | None:
    """(num_seqs, 1, max_query_len, num_keys) bool: causal, inside the context, inside the window.

    None when nothing needs masking: one sequence decoding one token over exactly its keys.
    Built once per step and window, then shared by every layer (through `meta.mask_cache`
    when the metadata offers one).
    """
    if meta.num_seqs == 1 and meta.max_query_len == 1 and num_keys == meta.max_context_len and window is None:
        return None
    cache = getattr(meta, "mask_cache", None)
    key = (num_keys, window)
    if cache is not None and key in cache:
        return cache[key]
    key_pos = mx.arange(num_keys)  # (num_keys,)
    query_pos = meta.query_pos[:, :, None]  # (num_seqs, max_query_len, 1)
    mask = (key_pos <= query_pos) & (key_pos < meta.context_lens[:, None, None])
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask[:, None]
    if cache is not None:
        cache[key] = mask
    return mask


def _grouped_attention(q, k, v, scale: float, mask: mx.array | None, softcap: float | None) -> mx.array:
    """Attention with the query heads of each KV head stacked into one matmul (GQA/MQA).

    q: (S, heads, Q, head_dim); k, v: (S, kv_heads, L, head_dim). One batched matmul per
    KV head, rather than one per query head, is twice as fast as MLX's CPU attention for
    decode steps and as fast for prefill. Optional tanh soft-capping (Gemma 2) of the scores.
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
    probs = _as(mx.softmax(_as(scores, mx.float32), axis=-1, precise=True), v.dtype)
    out = probs @ v  # (S, kv_heads, group * Q, head_dim)
    return out.reshape(num_seqs, num_heads, num_queries, -1)


def paged_attention_reference(
    queries: mx.array,
    key_pool: Pool,
    value_pool: Pool,
    meta,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> mx.array:
    """Attention of the flattened `queries` (num_tokens, heads, head_dim) over paged K/V.

    Gathers every sequence's blocks into a dense tensor (the copy the Metal kernel avoids),
    dequantizing quantized pools, pads queries to the longest query, and attends with a
    causal mask (keys at positions <= the query's, and, with `window`, > the query's
    position - window) and optional tanh soft-capping of the scores.
    A step that mixes decodes with longer query chunks attends in groups (all decodes
    together, each chunk alone), so a long prompt chunk does not pad every decode to its
    length and context. Returns (num_tokens, heads, head_dim).
    """
    if meta.max_query_len == 1 or meta.num_seqs == 1:
        return _attend_padded(queries, key_pool, value_pool, meta, scale, softcap, window)
    groups = _query_groups(meta)
    outs = [_attend_padded(queries[g.rows], key_pool, value_pool, g, scale, softcap, window) for g in groups]
    order = np.argsort(np.concatenate([g.rows_host for g in groups]), kind="stable")
    return mx.concatenate(outs)[mx.array(order.astype(np.int32))]  # back to the flattened order


@dataclass
class _GroupMeta:
    """The metadata fields the reference reads, for a subset of a step's sequences."""

    block_size: int
    block_tables: mx.array
    context_lens: mx.array
    query_pos: mx.array
    query_rows: mx.array
    token_rows: mx.array
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    rows: mx.array  # (group tokens,) rows of the step's flattened tokens
    rows_host: np.ndarray
    mask_cache: dict

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)


def _query_groups(meta) -> list[_GroupMeta]:
    """Decoding sequences in one group, every longer query chunk in its own (cached per step)."""
    cache = getattr(meta, "mask_cache", None)
    if cache is not None and "groups" in cache:
        return cache["groups"]
    q_lens = np.asarray(meta.query_lens)
    c_lens = np.asarray(meta.context_lens_host)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    decodes = np.flatnonzero(q_lens == 1)
    members = ([decodes] if len(decodes) else []) + [np.array([s]) for s in np.flatnonzero(q_lens > 1)]
    groups = [_group_meta(meta, ids, q_lens[ids], c_lens[ids], starts[ids]) for ids in members]
    if cache is not None:
        cache["groups"] = groups
    return groups


def _group_meta(meta, ids: np.ndarray, q_lens: np.ndarray, c_lens: np.ndarray, starts: np.ndarray) -> _GroupMeta:
    max_q = int(q_lens.max())
    grid = np.arange(max_q)[None, :]  # (1, max_q)
    valid = grid < q_lens[:, None]  # (group seqs, max_q)
    local_starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    rows = np.concatenate([np.arange(s, s + q) for s, q in zip(starts, q_lens)])  # (group tokens,)
    offsets = np.concatenate([np.arange(q) for q in q_lens])
    token_rows = np.repeat(np.arange(len(ids)), q_lens) * max_q + offsets
    i32 = lambda a: mx.array(np.asarray(a, dtype=np.int32))  # noqa: E731
    index = i32(ids)
    return _GroupMeta(
        block_size=meta.block_size,
        block_tables=meta.block_tables[index],
        context_lens=meta.context_lens[index],
        query_pos=i32((c_lens - q_lens)[:, None] + grid),
        query_rows=i32(np.where(valid, local_starts[:, None] + grid, 0).reshape(-1)),
        token_rows=i32(token_rows),
        query_lens=tuple(int(q) for q in q_lens),
        context_lens_host=tuple(int(c) for c in c_lens),
        rows=i32(rows),
        rows_host=rows,
        mask_cache={},
    )


def _attend_padded(
    queries: mx.array,
    key_pool: Pool,
    value_pool: Pool,
    meta,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> mx.array:
    """Attention of all sequences of `meta` at once, padded to its longest query and context."""
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    keys = _gather_sequences(key_pool, meta)  # (S, kv_heads, L, head_dim)
    values = _gather_sequences(value_pool, meta)
    decode_only = meta.max_query_len == 1  # one query per sequence: no padding, no reordering
    if meta.num_seqs == 1 and decode_only:
        keys, values = keys[:, :, : meta.max_context_len], values[:, :, : meta.max_context_len]
    if decode_only:
        q = queries[:, :, None, :]  # (S, heads, 1, head_dim)
    else:
        q = queries[meta.query_rows].reshape(meta.num_seqs, meta.max_query_len, num_heads, head_dim)
        q = q.transpose(0, 2, 1, 3)  # (S, heads, max_query_len, head_dim)
    mask = _attention_mask(meta, keys.shape[2], window)
    if softcap is None and mx.default_device() != mx.cpu:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    else:
        out = _grouped_attention(q, keys, values, scale, mask, softcap)
    if decode_only:
        return out[:, :, 0, :]  # (S, heads, head_dim)
    out = out.transpose(0, 2, 1, 3).reshape(-1, num_heads, out.shape[-1])  # (S * max_query_len, heads, head_dim)
    return out[meta.token_rows]


# ---------------------------------------------------------------- kernels

HEAD_DIMS = (64, 80, 96, 128, 256)
_FLOAT_POOLS = ("k_pool", "v_pool")
_QUANT_POOLS = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")
_ATTENTION_META = ("block_tables", "tiles", "seq_ids", "positions", "params", "window")


def _attention_source(quantized: bool, split: bool) -> KernelSource:
    pools = _QUANT_POOLS if quantized else _FLOAT_POOLS
    return KernelSource(
        name="base_paged_attention" + ("_q" if quantized else "") + ("_split" if split else ""),
        body="paged_attention.metal",
        input_names=("queries", *pools, *_ATTENTION_META),
        output_names=("part_o", "part_ml") if split else ("out",),
        headers=("paged_attention.h",),
        defines=(("BASE_KV_QUANT", int(quantized)), ("BASE_SPLIT", int(split))),
    )


ATTENTION_REDUCE = KernelSource(
    name="base_paged_attention_reduce",
    body="paged_attention_reduce.metal",
    input_names=("part_o", "part_ml"),
    output_names=("out",),
)
KV_QUANTIZE = KernelSource(
    name="base_kv_quantize",
    body="write_kv.metal",
    input_names=("rows",),
    output_names=("codes", "scales", "biases"),
)


def num_simdgroups(max_context_len: int) -> int:
    """Simdgroups per threadgroup (at most 8, a runtime choice): more of them share a long context's keys."""
    return 8 if max_context_len >= 512 else 4


def heads_per_threadgroup(num_heads: int, num_kv_heads: int) -> int:
    """Query heads of one KV head served together (each K/V chunk loaded once for them): <= 4, for registers."""
    group = num_heads // num_kv_heads
    return max(n for n in (1, 2, 3, 4) if group % n == 0)


def tokens_per_threadgroup(max_query_len: int, heads_per_group: int, head_dim: int) -> int:
    """Query tokens of one sequence served together (keys loaded once for them): 1 for pure decode.

    A threadgroup's query rows (tokens x heads) are capped at 8 (4 for head_dim 256) for registers.
    """
    if max_query_len == 1:
        return 1
    return max(1, (4 if head_dim > 128 else 8) // heads_per_group)


@functools.lru_cache(maxsize=256)
def query_tiles(query_lens: tuple[int, ...], tokens_per_tile: int) -> mx.array:
    """(num_tiles, 2) int32: first flattened token and token count of each tile; a tile stays in one sequence."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    per_seq = -(-q_lens // tokens_per_tile)  # tiles per sequence
    seq = np.repeat(np.arange(len(q_lens)), per_seq)  # (num_tiles,)
    index = np.arange(per_seq.sum()) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    first = starts[seq] + index * tokens_per_tile
    count = np.minimum(tokens_per_tile, q_lens[seq] - index * tokens_per_tile)
    return mx.array(np.stack([first, count], axis=1).astype(np.int32))


def num_key_splits(num_tokens: int, num_head_groups: int, max_context_len: int) -> int:
    """Key splits (flash decoding): only for long contexts with few threadgroups (tokens x head groups)."""
    num_groups = num_tokens * num_head_groups
    if max_context_len < 1024 or num_groups >= 512:
        return 1
    return max(1, min(32, max_context_len // 512, 512 // num_groups))


def kernel_supports(queries: mx.array, key_pool: Pool) -> bool:
    """Whether the attention kernel handles these shapes (else the reference runs)."""
    head_dim = queries.shape[-1]
    num_heads, num_kv_heads = queries.shape[1], key_pool.shape[2]
    return head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0


def paged_attention_kernel(
    queries: mx.array,
    key_pool: Pool,
    value_pool: Pool,
    meta,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    run: Runner = run_on_metal,
) -> mx.array:
    """`paged_attention_reference` as Metal kernels reading the pools through the block tables.

    One threadgroup per (tile of a sequence's query tokens, group of query heads sharing a KV
    head, key split): each K/V chunk read serves all of its query rows. With more than one
    split a reduce kernel merges the partial softmax states.
    Returns (num_tokens, heads, head_dim).
    """
    num_heads, head_dim = queries.shape[1:]
    gq = heads_per_threadgroup(num_heads, key_pool.shape[2])
    tiles = query_tiles(tuple(meta.query_lens), tokens_per_threadgroup(meta.max_query_len, gq, head_dim))
    splits = num_splits or num_key_splits(tiles.shape[0], num_heads // gq, meta.max_context_len)
    launch = _attention_launch(queries, key_pool, value_pool, meta, scale, softcap, window, tiles, splits)
    if splits == 1:
        return run(launch)[0]
    part_o, part_ml = run(launch)
    return run(_reduce_launch(part_o, part_ml, queries.dtype))[0]


def _attention_launch(
    queries, key_pool: Pool, value_pool: Pool, meta, scale, softcap, window, tiles: mx.array, splits: int
) -> Launch:
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = key_pool.shape[2]
    quantized = isinstance(key_pool, QuantizedPool)
    gq = heads_per_threadgroup(num_heads, num_kv_heads)
    qt = tokens_per_threadgroup(meta.max_query_len, gq, head_dim)
    nsg = num_simdgroups(meta.max_context_len)
    seq_ids = (meta.token_rows // meta.max_query_len).astype(mx.int32)  # (num_tokens,)
    params = mx.array([scale, softcap or 0.0], dtype=mx.float32)
    window_arr = mx.array([window or 0], dtype=mx.int32)
    pools = [*key_pool[:3], *value_pool[:3]] if quantized else [key_pool, value_pool]
    template = [
        ("T", queries.dtype),
        ("P", key_pool.dtype),
        ("D", head_dim),
        ("BS", key_pool.shape[1]),
        ("HEADS", num_heads),
        ("KV_HEADS", num_kv_heads),
        ("GQ", gq),
        ("QT", qt),
        ("SOFTCAP", softcap is not None),
        ("WINDOW", window is not None),
    ]
    if quantized:
        template += [("BITS", key_pool.bits), ("GROUP", key_pool.group_size)]
    if splits == 1:
        outputs = [(queries.shape, queries.dtype)]
    else:
        partial = (num_tokens, num_heads, splits)
        outputs = [((*partial, head_dim), mx.float32), ((*partial, 2), mx.float32)]
    return Launch(
        kernel=_attention_source(quantized, splits > 1),
        inputs=[queries, *pools, meta.block_tables, tiles, seq_ids, meta.positions, params, window_arr],
        template=template,
        grid=(splits * nsg * 32, num_heads // gq, tiles.shape[0]),
        threadgroup=(nsg * 32, 1, 1),
        output_shapes=[shape for shape, _ in outputs],
        output_dtypes=[dtype for _, dtype in outputs],
    )


def _reduce_launch(part_o: mx.array, part_ml: mx.array, dtype: mx.Dtype) -> Launch:
    """Merges part_o (tokens, heads, splits, head_dim) and part_ml (tokens, heads, splits, 2)."""
    num_tokens, num_heads, _, head_dim = part_o.shape
    return Launch(
        kernel=ATTENTION_REDUCE,
        inputs=[part_o, part_ml],
        template=[("T", dtype), ("D", head_dim)],
        grid=(head_dim, num_heads, num_tokens),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[(num_tokens, num_heads, head_dim)],
        output_dtypes=[dtype],
    )


def quantize_rows_kernel(
    rows: mx.array, bits: int, group_size: int, dtype: mx.Dtype, run: Runner = run_on_metal
) -> tuple[mx.array, mx.array, mx.array]:
    """`kv_quant.quantize_rows` for rows (num_tokens, kv_heads, head_dim), one thread per group."""
    num_tokens, num_kv_heads, head_dim = rows.shape
    num_groups = num_tokens * num_kv_heads * head_dim // group_size
    lead = (num_tokens, num_kv_heads)
    launch = Launch(
        kernel=KV_QUANTIZE,
        inputs=[rows],
        template=[("T", rows.dtype), ("P", dtype), ("D", head_dim), ("BITS", bits), ("GROUP", group_size)],
        grid=(num_groups, 1, 1),
        threadgroup=(min(256, num_groups), 1, 1),
        output_shapes=[(*lead, head_dim * bits // 32), *[(*lead, head_dim // group_size)] * 2],
        output_dtypes=[mx.uint32, dtype, dtype],
    )
    codes, scales, biases = run(launch)
    return codes, scales, biases


def write_kv_kernel(
    key_pool: Pool,
    value_pool: Pool,
    keys: mx.array,
    values: mx.array,
    slot_mapping: mx.array,
    run: Runner = run_on_metal,
) -> tuple[Pool, Pool]:
    """`write_kv_reference` with the quantization of new rows done by the kernel.

    NOTE: `mx.fast.metal_kernel` always allocates its outputs, so a kernel that wrote into
    the pool would have to copy the whole pool every step. The kernel therefore produces only
    the new rows' codes/scales/biases; MLX's scatter then writes them (and float rows) into
    the pool, in place when the caller holds the only reference to the pool (donation).
    """

    def write(pool: Pool, rows: mx.array) -> Pool:
        if not isinstance(pool, QuantizedPool):
            return _scatter(pool, _as(rows, pool.dtype), slot_mapping)
        parts = quantize_rows_kernel(rows, pool.bits, pool.group_size, pool.dtype, run)
        return _scatter_quantized(pool, parts, slot_mapping)

    return write(key_pool, keys), write(value_pool, values)


# ---------------------------------------------------------------- dispatch


def paged_attention(
    queries: mx.array,
    key_pool: Pool,
    value_pool: Pool,
    meta,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> mx.array:
    """Paged attention: the Metal kernel where it is available and passed its self-check, else the reference."""
    if kernel_supports(queries, key_pool):
        variant = _attention_variant(queries, key_pool, softcap, window)
        check = functools.partial(self_check.check_attention, queries, key_pool, softcap, window)
        if dispatch.use_kernel("paged_attention", variant, check):
            return paged_attention_kernel(queries, key_pool, value_pool, meta, scale, softcap, window)
    return paged_attention_reference(queries, key_pool, value_pool, meta, scale, softcap, window)


def write_kv(
    key_pool: Pool, value_pool: Pool, keys: mx.array, values: mx.array, slot_mapping: mx.array
) -> tuple[Pool, Pool]:
    """KV write: quantize-on-write by the Metal kernel where it is available and checked, else the reference."""
    if isinstance(key_pool, QuantizedPool):
        variant = (keys.dtype, keys.shape[1:], key_pool.bits, key_pool.dtype)
        check = functools.partial(self_check.check_write_kv, keys, key_pool)
        if dispatch.use_kernel("write_kv", variant, check):
            return write_kv_kernel(key_pool, value_pool, keys, values, slot_mapping)
    return write_kv_reference(key_pool, value_pool, keys, values, slot_mapping)


def _attention_variant(queries: mx.array, key_pool: Pool, softcap: float | None, window: int | None) -> tuple:
    bits = key_pool.bits if isinstance(key_pool, QuantizedPool) else 16
    return (queries.dtype, queries.shape[1:], key_pool.dtype, key_pool.shape[1:3], bits, softcap, window)
