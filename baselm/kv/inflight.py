"""The prefix blocks running requests are computing now, so a waiting request can wait for them
instead of computing the same blocks beside them (see `Scheduler._schedule_waiting`)."""

from __future__ import annotations

from collections.abc import Iterable

from baselm.kv.block_pool import BlockHash
from baselm.kv.manager import KVCacheManager
from baselm.request import Request


class InflightBlocks:
    """Hashes of the full blocks running requests are computing or have yet to compute in one schedule."""

    def __init__(self, kv: KVCacheManager, running: Iterable[Request]) -> None:
        self.kv = kv
        self.hashes: set[BlockHash] = set()
        if kv.enable_prefix_caching:
            for request in running:
                self.add(request, request.num_computed_tokens)

    def add(self, request: Request, num_computed: int) -> None:
        """Counts the full blocks of `request` past its first `num_computed` tokens as being computed."""
        if not self.kv.enable_prefix_caching:
            return
        num_full = request.num_tokens // self.kv.block_size
        first = num_computed // self.kv.block_size
        if first < num_full:
            self.hashes.update(self.kv.block_hashes(request, num_full)[first:num_full])

    def awaits(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the request's next block, one it could hit once cached, is being computed by another."""
        if not self.hashes or request.computes_whole_prompt:  # it takes no hits: nothing to wait for
            return False
        if num_hit_blocks >= (request.num_tokens - 1) // self.kv.block_size:
            return False
        return self.kv.block_hashes(request, num_hit_blocks + 1)[num_hit_blocks] in self.hashes
