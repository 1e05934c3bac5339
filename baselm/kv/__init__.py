"""Paged KV cache: block bookkeeping (pure Python), pools and attention metadata (MLX)."""

from baselm.kv.block_pool import BlockPool, KVBlock, hash_block
from baselm.kv.cache import LayerKV, PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.kv.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "BlockPool", "KVBlock", "KVCacheManager", "LayerKV", "PagedKVCache", "hash_block"]
