"""The Metal kernel wrappers: each builds the `Launch` of a kernel in this folder and hands it to a runner.

`paged_attention.metal` (with `paged_attention_reduce.metal` for key splits) computes
`reference.paged_attention_reference`; `write_kv.metal` quantizes new K/V rows as
`kv_quant.quantize_rows` does. The runner is MLX on Metal, or the tests' CPU emulator.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kv_quant import Pool, QuantizedPool
from baselm.metal.launch import KernelSource, Launch, Runner, run_on_metal
from baselm.metal.reference import write_pool

HEAD_DIMS = (64, 80, 96, 128, 256)
_FLOAT_POOLS = ("k_pool", "v_pool")
_QUANT_POOLS = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")
_ATTENTION_META = ("block_tables", "tiles", "seq_ids", "positions", "params", "window", "sinks")


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


def paged_attention_kernel(call: AttentionCall, num_splits: int | None = None, run: Runner = run_on_metal) -> mx.array:
    """`paged_attention_reference` as Metal kernels reading the pools through the block tables.

    One threadgroup per (tile of a sequence's query tokens, group of query heads sharing a KV
    head, key split): each K/V chunk read serves all of its query rows. With more than one
    split a reduce kernel merges the partial softmax states.
    Returns (num_tokens, heads, head_dim).
    """
    call.check()  # NOTE: the kernel indexes by these shapes; others would read past its buffers
    meta = call.meta
    num_heads, head_dim = call.queries.shape[1:]
    gq = heads_per_threadgroup(num_heads, call.key_pool.shape[2])
    tiles = query_tiles(tuple(meta.query_lens), tokens_per_threadgroup(meta.max_query_len, gq, head_dim))
    splits = num_splits or num_key_splits(tiles.shape[0], num_heads // gq, meta.max_context_len)
    launch = _attention_launch(call, tiles, splits)
    if splits == 1:
        return run(launch)[0]
    part_o, part_ml = run(launch)
    return run(_reduce_launch(part_o, part_ml, call.queries.dtype))[0]


def _attention_launch(call: AttentionCall, tiles: mx.array, splits: int) -> Launch:
    queries, key_pool, value_pool, meta = call.queries, call.key_pool, call.value_pool, call.meta
    softcap, window, sinks = call.softcap, call.window, call.sinks
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = key_pool.shape[2]
    quantized = isinstance(key_pool, QuantizedPool)
    gq = heads_per_threadgroup(num_heads, num_kv_heads)
    qt = tokens_per_threadgroup(meta.max_query_len, gq, head_dim)
    nsg = num_simdgroups(meta.max_context_len)
    seq_ids = (meta.token_rows // meta.max_query_len).astype(mx.int32)  # (num_tokens,)
    params = mx.array([call.scale, softcap or 0.0], dtype=mx.float32)
    window_arr = mx.array([window or 0], dtype=mx.int32)
    sinks_arr = mx.zeros((1,), mx.float32) if sinks is None else sinks.astype(mx.float32)  # (heads,) or unused
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
        ("SINKS", sinks is not None),
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
        inputs=[queries, *pools, meta.block_tables, tiles, seq_ids, meta.positions, params, window_arr, sinks_arr],
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
    if rows.ndim != 3 or bits not in (4, 8) or group_size < 1 or rows.shape[2] % group_size or group_size * bits % 32:
        raise ValueError(
            f"KV quantization: rows {rows.shape} must be (num_tokens, kv_heads, head_dim) with groups of {group_size} "
            f"that divide head_dim and fill whole words of {bits}-bit codes (bits 4 or 8)"
        )
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


def write_kv_kernel(write: KVWrite, run: Runner = run_on_metal) -> tuple[Pool, Pool]:
    """`write_kv_reference` with the quantization of new rows done by the kernel.

    NOTE: `mx.fast.metal_kernel` always allocates its outputs, so a kernel that wrote into
    the pool would have to copy the whole pool every step. The kernel therefore produces only
    the new rows' codes/scales/biases; MLX's scatter then writes them (and float rows) into
    the pool, in place when the caller holds the only reference to the pool (donation).
    """
    write.check()
    quantize = functools.partial(quantize_rows_kernel, run=run)
    key_pool = write_pool(write.key_pool, write.keys, write.slot_mapping, quantize)
    return key_pool, write_pool(write.value_pool, write.values, write.slot_mapping, quantize)
