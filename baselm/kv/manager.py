"""Which KV blocks each request holds: prefix-cache lookups, allocation, caching, forks, freeing."""

from __future__ import annotations

from collections.abc import Sequence

from baselm.kv.block_pool import BlockHash, BlockPool, ExtraKey, KVBlock, hash_block
from baselm.request import Request


class KVCacheManager:
    """Hands pool blocks to requests and names full blocks so equal prefixes share them.

    The scheduler drives it with a few verbs, in this order for a request:
    `get_computed_blocks` (once, when first scheduled), `allocate_slots` (every step),
    `cache_full_blocks` (after a step computed tokens), and `free` (finish or preemption).

    NOTE: a request's blocks cover at least num_computed_tokens + this step's tokens;
    block i holds tokens [i * block_size, (i + 1) * block_size).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"a KV block must hold at least one token, got block_size={block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # kept beside _blocks so block_table() is free
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already named in the pool
        self.prefix_cache_queries = 0  # tokens looked up, counted when a lookup is admitted
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def block_table(self, request: Request) -> list[int]:
        """The request's block ids in order; the live list, valid until the next allocation or free."""
        return self._block_ids.get(request.request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens, and their token count.

        The last token is always recomputed, since its logits are needed: only blocks lying
        wholly before it can hit, so a prompt of exactly k full blocks hits at most k - 1 of
        them and recomputes the whole last block rather than write into a shared one.
        Takes no references; pass the blocks to `allocate_slots`. A request that computes its
        whole prompt (prompt logprobs) takes no hits.
        """
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return [], 0
        num_hittable = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, num_hittable)
        blocks = []
        for block_hash in hashes[:num_hittable]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] | None = None
    ) -> bool:
        """Makes the request's blocks cover `num_computed_tokens` + hits + `num_new_tokens`.

        `computed_blocks` (from `get_computed_blocks`, for a request that holds no blocks yet)
        are taken as hits beyond `request.num_computed_tokens`, which the caller advances
        afterwards. Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        request_id = request.request_id
        held = self._blocks.get(request_id)
        computed = computed_blocks or ()
        if computed and held:
            raise ValueError(
                f"request {request_id} already holds KV blocks; prefix hits apply only to its first allocation"
            )
        num_held = len(held) if held else 0
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - num_held - len(computed)
        if num_needed <= 0 and computed_blocks is None:  # the common decode step: the last block has room
            return True
        num_reclaimed = sum(1 for block in computed if block.ref_cnt == 0)  # hits sitting in the free list
        if max(num_needed, 0) + num_reclaimed > self.pool.num_free_blocks:
            return False
        if held is None:
            held = self._blocks[request_id] = []
            self._block_ids[request_id] = []
            self._num_cached_blocks[request_id] = 0
        if computed:
            self._take(request_id, computed, touch=True)
        if num_needed > 0:
            self._take(request_id, self.pool.allocate(num_needed), touch=False)
        if computed_blocks is not None:
            self._num_cached_blocks[request_id] = len(computed)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Names the request's blocks that its computed tokens have filled, so later requests hit them."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        num_full = min(request.num_computed_tokens // self.block_size, len(self._blocks[request_id]))
        start = self._num_cached_blocks[request_id]
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        blocks = self._blocks[request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Lets a new `child` with the same prompt (n > 1) share the parent's computed full blocks.

        Only full blocks before the child's last token are shared (ref counts); the child
        recomputes the rest, at most one block, so no block is ever copied or written twice.
        Sets the child's num_computed_tokens to match.
        """
        if child.request_id in self._blocks or child.num_computed_tokens or child.output_token_ids:
            raise ValueError(f"request {child.request_id} has already started; only a new request can be forked")
        if parent.all_token_ids[: child.num_tokens] != child.all_token_ids:
            raise ValueError(f"request {child.request_id} does not start with the tokens of {parent.request_id}")
        if child.adapters != parent.adapters:
            raise ValueError(
                f"request {child.request_id} runs other adapters than {parent.request_id}; their K/V differ"
            )
        num_shared = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        shared = self._blocks.get(parent.request_id, [])[:num_shared]
        self._blocks[child.request_id] = []
        self._block_ids[child.request_id] = []
        self._take(child.request_id, shared, touch=True)
        self._num_cached_blocks[child.request_id] = min(num_shared, self._num_cached_blocks.get(parent.request_id, 0))
        if (child.cache_salt, child.adapters) == (parent.cache_salt, parent.adapters):
            child.block_hashes = parent.block_hashes[:num_shared]
        child.num_computed_tokens = num_shared * self.block_size

    def free(self, request: Request) -> None:
        """Gives back the request's blocks, last block first, so a prefix's tail is evicted before its head."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, None)
        if blocks is None:
            return
        del self._block_ids[request_id]
        del self._num_cached_blocks[request_id]
        self.pool.free(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past the first `num_tokens` tokens, last block first
        (speculative slots that were rejected). NOTE: those blocks never hold a cached prefix:
        only blocks filled by computed tokens are named, and computed tokens lie before `num_tokens`."""
        blocks = self._blocks.get(request.request_id)
        if blocks is None:
            return
        num_kept = -(-num_tokens // self.block_size)
        if len(blocks) <= num_kept:
            return
        dropped = blocks[num_kept:]
        del blocks[num_kept:]
        del self._block_ids[request.request_id][num_kept:]
        self._num_cached_blocks[request.request_id] = min(self._num_cached_blocks[request.request_id], num_kept)
        self.pool.free(reversed(dropped))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (e.g. after weights change); returns how many blocks were dropped."""
        return self.pool.reset_prefix_cache()

    def _take(self, request_id: str, blocks: Sequence[KVBlock], touch: bool) -> None:
        if touch:
            self.pool.touch(blocks)
        self._blocks[request_id].extend(blocks)
        self._block_ids[request_id].extend(block.block_id for block in blocks)

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained full-block hashes, extended in place on the request to `num_blocks`."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size], _extra_keys(request, i, size)))
        return hashes


def _extra_keys(request: Request, block_index: int, block_size: int) -> tuple[ExtraKey, ...]:
    """What besides tokens goes into a block's hash. On the first block (the chain carries them): the
    cache salt, then the LoRA adapters the request runs with (their `cache_key`). On every block: the
    key of each image whose placeholders it holds, so two images never share K/V (their placeholder
    ids are the same) and the same image in the next turn hits."""
    keys: tuple[ExtraKey, ...] = ()
    if block_index == 0 and request.cache_salt is not None:
        keys = (request.cache_salt,)
    if block_index == 0 and request.adapters is not None:
        keys += (request.adapters.cache_key,)
    if request.images:
        first, end = block_index * block_size, (block_index + 1) * block_size
        keys += tuple(image.key for image in request.images if image.start < end and first < image.end)
    return keys
