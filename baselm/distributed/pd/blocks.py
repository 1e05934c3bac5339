"""KV blocks as one flat byte buffer: what a prefill rank ships and a decode rank writes into its pool.

A block's bytes are its rows in every pool array, in a fixed order: for each layer, K then V,
each pool's arrays (one, or a quantized pool's codes, scales and biases). `pack` gathers the
rows of some blocks of a cache into one uint8 array (array-major: all blocks of one array,
then the next), `unpack` scatters such a buffer into other block ids of a cache of the same
layout. Quantized pools travel packed, as they are stored: a q4 block ships a quarter of the
bytes of an f16 one (plus its scales and biases). Block ids outside the cache and a buffer of
another size or dtype than the blocks take are a ValueError before any row is read or written.
"""

from __future__ import annotations

import mlx.core as mx

from baselm.kv.cache import LayerKV, PagedKVCache, pool_arrays, set_pool_rows


def layout(cache: PagedKVCache) -> list[list]:
    """What a shipped block must fit: each pool array's dtype and per-block shape, and the layer count.

    Two ranks exchange blocks only when their layouts are equal (same model, block size, KV bits)."""
    arrays = pool_arrays(cache[0].keys)
    return [[len(cache), cache.block_size, cache.kv_bits], *[[str(a.dtype), list(a.shape[1:])] for a in arrays]]


def block_nbytes(cache: PagedKVCache) -> int:
    """Bytes one block takes across all layers, K and V (what `pack` sends per block)."""
    per_pool = sum(a.nbytes // a.shape[0] for a in pool_arrays(cache[0].keys))
    return 2 * len(cache) * per_pool


def pack(cache: PagedKVCache, block_ids: list[int]) -> mx.array:
    """The K/V of `block_ids`, as one flat uint8 array of len(block_ids) * block_nbytes(cache) bytes."""
    cache.check_block_ids(block_ids)
    ids = mx.array(block_ids, dtype=mx.int32)
    parts = [
        mx.view(array[ids], mx.uint8).reshape(-1)
        for layer in cache.layers
        for pool in (layer.keys, layer.values)
        for array in pool_arrays(pool)
    ]
    return mx.concatenate(parts)  # (len(block_ids) * block_nbytes,)


def unpack(cache: PagedKVCache, block_ids: list[int], data: mx.array) -> None:
    """Writes a `pack`ed buffer into `block_ids` of `cache` (same layout), block i into block_ids[i]."""
    cache.check_block_ids(block_ids)
    expected = len(block_ids) * block_nbytes(cache)
    if data.dtype != mx.uint8 or data.ndim != 1 or data.size != expected:
        raise ValueError(
            f"a KV transfer of {data.size} {data.dtype} values in {data.ndim} dimension(s) cannot fill "
            f"{len(block_ids)} blocks: they take a flat uint8 buffer of {expected} bytes"
        )
    ids = mx.array(block_ids, dtype=mx.int32)
    offset = 0
    for layer in cache.layers:
        for kind in ("keys", "values"):
            offset = _unpack_pool(layer, kind, ids, data, offset)
    mx.eval([(layer.keys, layer.values) for layer in cache.layers])


def _unpack_pool(layer: LayerKV, kind: str, ids: mx.array, data: mx.array, offset: int) -> int:
    for index, array in enumerate(pool_arrays(getattr(layer, kind))):
        size = ids.size * (array.nbytes // array.shape[0])
        rows = mx.view(data[offset : offset + size], array.dtype).reshape(ids.size, *array.shape[1:])
        set_pool_rows(layer, kind, index, ids, rows)
        offset += size
    return offset
