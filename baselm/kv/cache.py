"""KV pools: one pair of preallocated pools per layer, written in place through slot mappings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx

from baselm import cpu
from baselm.metal import AttentionMetadata, KVWrite, Pool, allocate_pool
from baselm.metal.kv_quant import kv_group_size
from baselm.paged_attention import write_kv

_QUANTIZED_PARTS = ("codes", "scales", "biases")


def pool_arrays(pool: Pool) -> list[mx.array]:
    """A pool's arrays: itself, or a quantized pool's codes, scales and biases."""
    return [pool] if isinstance(pool, mx.array) else [getattr(pool, part) for part in _QUANTIZED_PARTS]


def set_pool_rows(layer: LayerKV, kind: str, index: int, ids: mx.array, rows: mx.array) -> None:
    """Rows `ids` (blocks) of array `index` (see `pool_arrays`) of `layer`'s "keys" or "values" pool take `rows`."""
    pool = getattr(layer, kind)
    if isinstance(pool, mx.array):
        pool[ids] = rows
        setattr(layer, kind, pool)
        return
    parts = pool_arrays(pool)
    parts[index][ids] = rows
    setattr(layer, kind, pool._replace(**dict(zip(_QUANTIZED_PARTS, parts))))


def _zeros_here() -> Callable[[tuple[int, ...], mx.Dtype], mx.array]:
    """How pools are zeroed on this device: on the CPU with the kernels, as pages mapped on first
    touch (a pool sized for a whole context then costs no start time and no memory until its
    blocks are written); elsewhere `mx.zeros`."""
    if mx.default_device() != mx.cpu or cpu.kernels is None:
        return mx.zeros
    return lambda shape, dtype: cpu.kernels.zeroed(list(shape), _DTYPE_NAMES[dtype])


_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16", mx.uint32: "uint32"}


class KVShaped(Protocol):
    """What sizes a cache for a model: its KV shape and dtype (models.base.DecoderModel has both)."""

    @property
    def dtype(self) -> mx.Dtype: ...

    def kv_shape(self) -> tuple[int, int, int]: ...


class LayerKV:
    """The K and V pools of one attention layer: what a model's attention layer reads and writes.

    A pool is (num_blocks, block_size, kv_heads, head_dim) in the model dtype, or for
    kv_bits 8/4 a `QuantizedPool` (codes, scales, biases) of the same leading shape.
    """

    __slots__ = ("keys", "values")
    keys: Pool  # (num_blocks, block_size, kv_heads, head_dim)
    values: Pool  # (num_blocks, block_size, kv_heads, head_dim)

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, kv_bits: int
    ):
        zeros = _zeros_here()
        self.keys = allocate_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_bits, zeros)
        self.values = allocate_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_bits, zeros)

    def write(self, keys: mx.array, values: mx.array, meta: AttentionMetadata) -> None:
        """Stores this step's rows, (num_tokens, kv_heads, head_dim), at `meta.slot_mapping`.

        NOTE: the pools are rebound to the scatter's result; with no other reference alive
        MLX donates the old buffer, so the write happens in place.
        """
        self.keys, self.values = write_kv(KVWrite(self.keys, self.values, keys, values, meta.slot_mapping))


class PagedKVCache:
    """Per-layer KV pools sized once; the engine hands out blocks, models only read and write slots."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float32,
        kv_bits: int = 16,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_bits = kv_bits
        self.layers = [
            LayerKV(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_bits) for _ in range(num_layers)
        ]
        mx.eval([(layer.keys, layer.values) for layer in self.layers])  # allocate now, not in the first step

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def check_block_ids(self, block_ids: list[int]) -> None:
        """Raises ValueError unless every id names a block of this cache. NOTE: MLX checks no index:
        a gather past a pool reads other memory and a scatter past it writes there."""
        bad = next((b for b in block_ids if not 0 <= b < self.num_blocks), None)
        if bad is not None:
            raise ValueError(f"block id {bad} is outside this KV cache's {self.num_blocks} blocks")

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, kv_bits: int) -> int:
        """Pool bytes one cached token takes across all layers (K and V, with quantization scales)."""
        if kv_bits == 16:
            per_row = head_dim * dtype.size
        else:
            per_row = head_dim * kv_bits // 8 + 2 * (head_dim // kv_group_size(head_dim)) * dtype.size
        return 2 * num_layers * num_kv_heads * per_row

    @classmethod
    def for_model(
        cls, model: KVShaped, num_blocks: int, block_size: int = 16, dtype: mx.Dtype | None = None, kv_bits: int = 16
    ) -> PagedKVCache:
        """A cache shaped for `model` (anything with `kv_shape()` and `dtype`)."""
        num_layers, num_kv_heads, head_dim = model.kv_shape()
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype or model.dtype, kv_bits)
