"""Paged KV cache: pools, attention metadata, and (in the engine) block management."""

from baselm.kv.cache import LayerKV, PagedKVCache
from baselm.kv.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "LayerKV", "PagedKVCache"]
