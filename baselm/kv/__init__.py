"""Paged KV cache: block bookkeeping (pure Python), pools and attention metadata (MLX).

`AttentionMetadata` is defined in `baselm.metal` (the attention kernels read it, and that
package imports nothing from the engine); the engine takes it from here with the cache.
"""

from baselm.kv.block_pool import BlockPool, KVBlock, hash_block
from baselm.kv.cache import LayerKV, PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.metal import AdapterRows, AttentionMetadata

__all__ = [
    "AdapterRows",
    "AttentionMetadata",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "LayerKV",
    "PagedKVCache",
    "hash_block",
]
