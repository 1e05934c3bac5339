"""KV pools on the CPU: mapped on first touch, so a pool sized for a whole context costs neither
start time nor memory until its blocks are written, and written in place like any other pool."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu
from baselm.kv.cache import PagedKVCache
from baselm.metal import AttentionMetadata

requires_kernels = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels not loaded: {cpu.status['reason']}")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@requires_kernels
def test_a_cpu_pool_takes_no_memory_until_written() -> None:
    before = _resident_bytes()
    cache = PagedKVCache(num_layers=4, num_blocks=2048, block_size=16, num_kv_heads=4, head_dim=64)  # 512 MiB
    assert cache.nbytes == 4 * 2 * 2048 * 16 * 4 * 64 * 4
    assert _resident_bytes() - before < 16 * 2**20
    meta = AttentionMetadata.build([[5]], query_lens=[16], context_lens=[16], block_size=16)
    for layer in cache.layers:  # a write takes the mapped pool itself, not a copy of it
        layer.write(mx.ones((16, 4, 64)), mx.ones((16, 4, 64)), meta)
        mx.eval(layer.keys, layer.values)
    assert _resident_bytes() - before < 16 * 2**20
    assert mx.array_equal(cache[3].values[2047], mx.zeros((16, 4, 64))).item()
    assert mx.array_equal(cache[3].values[5], mx.ones((16, 4, 64))).item()


@requires_kernels
def test_the_pools_resident_bytes_count_the_pages_written() -> None:
    before = cpu.kernels.mapped_resident_bytes()
    cache = PagedKVCache(num_layers=2, num_blocks=512, block_size=16, num_kv_heads=4, head_dim=64)  # 2 x 2 x 8 MiB
    headers = 4 * os.sysconf("SC_PAGESIZE")  # each pool's first page holds the size MLX reads before its data
    assert cpu.kernels.mapped_resident_bytes() - before == headers
    meta = AttentionMetadata.build([[5, 300]], query_lens=[32], context_lens=[32], block_size=16)
    for layer in cache.layers:
        layer.write(mx.ones((32, 4, 64)), mx.ones((32, 4, 64)), meta)
        mx.eval(layer.keys, layer.values)
    block = 16 * 4 * 64 * 4  # 16 KiB: four pages a block, two blocks, keys and values, two layers
    assert cpu.kernels.mapped_resident_bytes() - before == headers + 2 * 2 * 2 * block
    del cache, layer
    assert cpu.kernels.mapped_resident_bytes() == before  # unmapped with the pools


@requires_kernels
def test_a_pool_someone_still_holds_is_copied_not_written() -> None:
    """In place only when the write holds the pool's one handle, as MLX's own donation rule."""
    pool = cpu.kernels.zeroed([4, 2, 1, 8], "float32")
    written = cpu.kernels.write_pool(pool, mx.ones((1, 1, 8)), mx.array([3], dtype=mx.int32))
    mx.eval(written)
    assert not pool.any().item()
    assert written.reshape(8, 8)[3].tolist() == [1.0] * 8


@requires_kernels
@pytest.mark.parametrize("kv_bits", [16, 8])
def test_a_cpu_pool_is_written_in_place(kv_bits: int) -> None:
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=32, kv_bits=kv_bits)
    layer = cache[0]
    rows = mx.arange(3 * 2 * 32, dtype=mx.float32).reshape(3, 2, 32) / 64
    meta = AttentionMetadata.build([[1, 7]], query_lens=[3], context_lens=[6], block_size=4)  # positions 3-5
    layer.write(rows, -rows, meta)
    mx.eval(layer.keys, layer.values)
    keys = layer.keys if kv_bits == 16 else layer.keys.codes
    flat = np.array(keys).reshape(8 * 4, -1)
    written = [7, 28, 29]  # block 1 offset 3, block 7 offsets 0 and 1
    assert all(flat[slot].any() for slot in written)
    assert not np.delete(flat, written, axis=0).any()
