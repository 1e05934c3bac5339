"""Prefix cache files over a tensor-parallel group: rank R of N keeps its KV heads' blocks in FILE.tpR.

Rank 0 owns the block tables and the prefix cache's hash map; every rank's pool holds its own KV
heads at the same block ids. So rank 0 decides, and its step plans (dist/plan.py) tell the others:
- save (rank 0's save interval, and as the server stops): rank 0 picks the blocks (most recently
  used first, at most --prefix-cache-max-size) and sends their ids and hashes in a SAVE plan;
  every rank writes those blocks of its pool to its own file, in kv/persist.py's format, stamped
  with its rank and the group's size.
- load (at start-up): rank 0 reads its file, takes pool blocks for it and sends their ids and
  hashes in a LOAD plan; every rank reads its own file and checks it is usable (whole, for this
  model, KV layout, rank and group size) and holds the same blocks; one all_sum gathers every
  rank's verdict. Only when every rank's file is usable are the blocks restored, on every rank;
  otherwise every rank starts empty and rank 0 logs one warning giving each rank's verdict. A
  save that failed on one rank leaves that rank's older file, whose blocks differ from the
  others': the next start is empty, never a mix.
Over a hostfile each rank's file is on its own machine (the path given to each rank's command).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.distributed.comm import all_sum, run_collective
from baselm.distributed.tp.plan import LOAD, SAVE, StepPlan, send_plan
from baselm.kv import PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.kv.persist import (
    GROUP_SUFFIX,
    Unusable,
    chosen_blocks,
    fingerprint,
    read_file,
    restore,
    weights_fingerprint,
    write_file,
    write_rows,
)

log = logging.getLogger(__name__)

ABSENT, USABLE, UNUSABLE, DIFFERENT = 1, 2, 3, 4  # a rank's verdict on its own file
_VERDICTS = {
    ABSENT: "no file",
    USABLE: "usable",
    UNUSABLE: "unusable (corrupt, or saved for another model, KV layout or group size)",
    DIFFERENT: "holds other blocks than rank 0's (saved at another time)",
}


def rank_prefix_file(path: str, rank: int) -> Path:
    """The prefix cache file of rank `rank` of a group started with `--prefix-cache-file path`."""
    return Path(f"{path}{GROUP_SUFFIX}{rank}").expanduser()


def blocks_payload(block_ids: list[int], hashes: list[int]) -> np.ndarray:
    """A SAVE or LOAD plan's payload: the block ids, then each 128-bit hash as 4 words, low first."""
    words = [(h >> (32 * i)) & 0xFFFFFFFF for h in hashes for i in range(4)]
    ids = np.asarray(block_ids, dtype=np.int32)
    return np.concatenate([ids, np.asarray(words, dtype=np.uint32).view(np.int32)])


def payload_blocks(payload: np.ndarray) -> tuple[list[int], list[int]]:
    """(block ids, hashes) of a SAVE or LOAD plan's payload."""
    num = len(payload) // 5
    words = np.asarray(payload[num:]).view(np.uint32).reshape(num, 4).tolist()
    return payload[:num].tolist(), [a | b << 32 | c << 64 | d << 96 for a, b, c, d in words]


class RankFile:
    """One rank's prefix cache file (none when `path` is None): read and judged, written when told."""

    def __init__(self, path: str | None, weights: Path | None, rank: int, size: int):
        self.path = rank_prefix_file(path, rank) if path else None
        self.weights, self.rank, self.size = weights, rank, size
        self._weights_print: str | None = None
        if self.path is not None:  # temporary files a killed save left (a file belongs to one rank)
            for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                stale.unlink(missing_ok=True)

    def stamp(self, cache: PagedKVCache) -> dict[str, Any]:
        if self._weights_print is None:
            self._weights_print = weights_fingerprint(self.weights)
        return {**fingerprint(self._weights_print, cache), "tensor_parallel": [self.rank, self.size]}

    def read(self, cache: PagedKVCache) -> tuple[int, list[int], list, str]:
        """(verdict, hashes, arrays, why): ABSENT, UNUSABLE or USABLE."""
        if self.path is None or not self.path.exists():
            return ABSENT, [], [], _VERDICTS[ABSENT]
        try:
            hashes, arrays = read_file(self.path, cache, self.stamp(cache), cache.num_blocks)
        except Unusable as exc:
            return UNUSABLE, [], [], f"{self.path}: {exc}"
        return USABLE, hashes, arrays, _VERDICTS[USABLE]

    def write(self, cache: PagedKVCache, block_ids: list[int], hashes: list[int]) -> None:
        if self.path is not None:
            write_file(self.path, cache, self.stamp(cache), hashes, block_ids)

    def follow(self, plan: StepPlan, cache: PagedKVCache, group: Any) -> None:
        """A rank other than 0 runs rank 0's SAVE or LOAD plan on its pool `cache`."""
        block_ids, hashes = payload_blocks(plan.payload)
        if plan.op == SAVE:
            try:
                self.write(cache, block_ids, hashes)
            except Exception as exc:  # a full disk must not take the group down; the next start is empty
                log.warning("rank %d could not save its prefix cache file: %s", self.rank, exc)
            return
        verdict, saved, arrays, why = self.read(cache)
        if verdict == USABLE and saved[: len(hashes)] != hashes:
            verdict, why = DIFFERENT, _VERDICTS[DIFFERENT]
        log.debug("rank %d prefix cache file: %s", self.rank, why)
        if all(v == USABLE for v in gather(verdict, self.rank, self.size, group)) and block_ids:
            write_rows(cache, block_ids, arrays)


def gather(verdict: int, rank: int, size: int, group: Any) -> list[int]:
    """Every rank's verdict, on every rank (all ranks call it together)."""
    votes = np.zeros(size, dtype=np.int32)  # (size,)
    votes[rank] = verdict
    out = all_sum(mx.array(votes), group)
    run_collective(mx.eval, out)
    return np.asarray(out).tolist()


class GroupPrefixCache:
    """Rank 0's side: the group's files bound to its pool; loaded once, saved when due and at
    shutdown (the same calls as one process's `PersistentPrefixCache`)."""

    def __init__(self, model: Any, path: str, weights: Path, kv: KVCacheManager, cache: PagedKVCache, max_size):
        group = model.dist_group
        self.model, self.kv, self.cache = model, kv, cache
        self.file = RankFile(path, weights, 0, group.size)
        self.path, self.pattern = self.file.path, f"{path}{GROUP_SUFFIX}R"
        self.max_bytes = cache.nbytes if max_size is None else max_size
        self.saved_version = -1

    def load(self) -> int:
        """Every rank's blocks restored, or none on any rank; returns how many."""
        verdict, hashes, arrays, why = self.file.read(self.cache)
        num = min(len(hashes), self.kv.pool.num_free_blocks)
        blocks = self.kv.pool.allocate(num) if num else []
        block_ids, hashes = [b.block_id for b in blocks], hashes[:num]
        votes = self.model.on_group(self._load_step, verdict, block_ids, hashes)
        if all(v == USABLE for v in votes):
            if blocks:
                restore(self.kv, self.cache, blocks, hashes, arrays)
        else:
            self.kv.pool.free(blocks)
            num = 0
            if any(v != ABSENT for v in votes):
                each = "; ".join(f"rank {r}: {_VERDICTS[v]}" for r, v in enumerate(votes))
                own = f" (rank 0's: {why})" if verdict == UNUSABLE else ""
                log.warning(
                    "ignoring the prefix cache files %s: every rank needs its own usable file: %s%s; "
                    "every rank starts with an empty cache",
                    self.pattern,
                    each,
                    own,
                )
        self.saved_version = self.kv.pool.version
        return num

    def _load_step(self, verdict: int, block_ids: list[int], hashes: list[int]) -> list[int]:
        group = self.model.dist_group
        self._send(LOAD, block_ids, hashes)
        return gather(verdict, 0, group.size, group.group)

    def _send(self, op: int, block_ids: list[int], hashes: list[int]) -> None:
        cache_id = self.model.announce(self.cache)
        plan = StepPlan(op, cache_id=cache_id, payload=blocks_payload(block_ids, hashes))
        send_plan(plan, self.model.dist_group.group)

    def save(self) -> int | None:
        """Every rank writes its file when the cache changed since the last save; returns blocks
        written (None: unchanged). Rank 0's own failure raises, as one process's does."""
        if self.kv.pool.version == self.saved_version:
            return None
        version = self.kv.pool.version
        blocks = chosen_blocks(self.kv, self.cache, self.max_bytes)
        block_ids, hashes = [b.block_id for b in blocks], [b.block_hash for b in blocks]
        self.model.on_group(self._send, SAVE, block_ids, hashes)
        self.file.write(self.cache, block_ids, hashes)
        self.saved_version = version
        return len(blocks)
