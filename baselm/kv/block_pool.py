"""KV blocks, their content hashes, and the pool that hands them out with lazy LRU eviction.

A block holds the K/V of `block_size` consecutive tokens of one sequence. Once full, it is
named by a hash chained over everything before it, so a later request with the same prefix
can reuse it. A freed block keeps its hash and stays findable until a fresh allocation needs
its memory: the free list doubles as the prefix cache's LRU list.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

BlockHash = int  # a 128-bit xxh3 digest, as a Python int
ExtraKey = int | str | bytes

_BIG_ENDIAN = sys.byteorder == "big"


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> BlockHash:
    """The content hash of a full block: `H(parent_hash, token ids, extra keys)`.

    Stable across processes and machines (xxh3-128 over a canonical little-endian encoding,
    never Python's salted `hash()`). `extra_keys` name anything besides the tokens that
    changes the K/V (a cache salt, an adapter, an image), so such blocks never collide.
    """
    h = xxhash.xxh3_128()
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little"))
    tokens = array("q", token_ids)  # int64 each
    if _BIG_ENDIAN:
        tokens.byteswap()
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    for key in extra_keys:
        h.update(_encode_extra_key(key))
    return h.intdigest()


def _encode_extra_key(key: ExtraKey) -> bytes:
    """Tag, length and payload, so ("ab",) and ("a", "b") encode differently."""
    if isinstance(key, bytes):
        tag, payload = b"b", key
    elif isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode("ascii")
    else:
        raise TypeError(f"a block hash extra key must be int, str or bytes, not {type(key).__name__}")
    return tag + len(payload).to_bytes(4, "little") + payload


class KVBlock:
    """One block of the pool: its id (its row in every layer's pool), users, and content hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"KVBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    """A fixed set of blocks with an LRU free list and a hash -> block map for prefix hits.

    The free list is an OrderedDict keyed by block id (O(1) pop, append, remove). Fresh
    allocations take its head; `free` puts blocks that hold a cached prefix at its tail and
    blocks with no hash at its head, since those can never be hit again and are the
    cheapest to give away.

    NOTE: a block is in the free list exactly when its ref_cnt is 0; blocks in use are
    never evicted. Free blocks with a hash stay in the hash map until reallocated.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.version = 0  # bumped whenever a block is cached or evicted (what a saved copy compares)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody uses, cached ones included: all of them can be allocated."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free list from head (next to be allocated) to tail (evicted last)."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` fresh blocks from the head of the free list, evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} KV blocks: only {len(self._free)} are free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes one more reference on each block (a prefix hit or a fork), pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference on each block, in the given order; unused ones join the free list.

        Blocks with a hash go to the tail, in order, so the first block given is evicted
        first among them: callers pass a sequence's blocks last-to-first, so the tail of a
        prefix goes before its head (which more requests share). Blocks without a hash go to
        the head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} was freed more often than it was taken")
            self._free[block.block_id] = block
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Names a full block by its hash so later requests can hit it.

        Returns False (and leaves the block unnamed) when it already has a hash or another
        block already holds the same content: the first one computed stays the cached copy.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.version += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Forgets every hash, in use or not; returns how many cached blocks were dropped.

        Blocks in use keep their K/V and owners; they just cannot be hit any more.
        """
        num_dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.version += 1
        return num_dropped

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            self.version += 1
