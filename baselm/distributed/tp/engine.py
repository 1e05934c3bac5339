"""The engine over a tensor-parallel group: rank 0 leads, the other ranks follow its plans.

Rank 0 runs the whole engine (HTTP, tokenizer, scheduler, sampler) on a `TensorParallelModel`:
the model the runner calls, which sends every forward's plan (dist/plan.py) to the other ranks
and then runs its own shard. The other ranks run `follow`: receive a plan, run the same forward
on their shard (the layers' all_sums pair up with rank 0's), repeat until STOP. Only rank 0
computes logits; the others stop at the last hidden state.
With a prefix cache file, rank 0's plans also have every rank save or load its own file
(dist/tp_persist.py).

Each forward is evaluated before the call returns, so a rank that dies or hangs mid-step
surfaces here as a RankFailedError instead of blocking the engine thread forever. On the CPU
this costs nothing: MLX's CPU backend computes while it builds the graph anyway. A rank other
than 0 has nothing to serve: its watchdog ends the process when a step outlasts the deadline.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import mlx.core as mx

from baselm.distributed.comm import MessageError, run_collective
from baselm.distributed.group import DistGroup, RankFailedError
from baselm.distributed.tp.persist import GroupPrefixCache, RankFile
from baselm.distributed.tp.plan import CACHE, FORWARD, FREE, HIDDEN, LOAD, SAVE, STOP, StepPlan, receive_plan, send_plan
from baselm.distributed.watchdog import Watchdog
from baselm.kv import AttentionMetadata, PagedKVCache

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 600.0  # a forward longer than this means a rank is stuck (a long prefill on a big model fits)


class TensorParallelModel:
    """Rank 0's model: the local shard, behind which every forward is also run by the other ranks.

    Everything else (args, kv_shape, dtype, layers, ...) is the shard's own. Each forward runs on
    one helper thread while the caller waits on it and watches the group: MLX's ring backend
    notices a dead peer and raises, but not always (measured: about one kill in three left the
    evaluation blocked after "Failing pending tasks"). So the caller also checks the ranks this
    process started and a deadline, and raises RankFailedError itself; a stuck helper thread is
    left behind and every later call fails at once.
    """

    def __init__(self, model: Any, group: DistGroup, step_timeout: float = STEP_TIMEOUT_S):
        self.inner = model
        self.dist_group = group
        self.step_timeout = step_timeout
        self.failed: RankFailedError | None = None
        self._pool = _StepThread()
        self._cache_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_cache_id = itertools.count(1)
        self._freed: list[int] = []  # caches gone on rank 0 whose pools the other ranks still hold
        self._stopped = False
        self.num_forwards = 0  # forwards run over the group
        self.num_tokens = 0  # tokens those forwards fed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata, cache: PagedKVCache):
        return self._run(FORWARD, self.inner, input_ids, positions, meta, cache)

    def hidden_states(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata, cache: PagedKVCache):
        return self._run(HIDDEN, self.inner.hidden_states, input_ids, positions, meta, cache)

    def _run(self, op: int, fn, input_ids, positions, meta, cache) -> mx.array:
        self.num_forwards += 1
        self.num_tokens += input_ids.size
        return self.on_group(self._step, op, fn, input_ids, positions, meta, cache)

    def on_group(self, fn, *args: Any) -> Any:
        """`fn(*args)` on the step thread, in order with the forwards (it may send plans), waited for."""
        if self.failed is not None:
            raise self.failed
        try:
            return self._wait(self._pool.submit(fn, *args))
        except RankFailedError as e:
            self.failed = e
            log.error("tensor parallelism stopped: %s", e)
            raise

    def open_prefix_cache(self, path: str, weights, kv, cache: PagedKVCache, max_size: int | None) -> GroupPrefixCache:
        """The group's prefix cache files (rank R: `path`.tpR), loaded on every rank or on none."""
        files = GroupPrefixCache(self, path, weights, kv, cache, max_size)
        files.load()
        return files

    def _step(self, op: int, fn, input_ids, positions, meta, cache) -> mx.array:
        """On the helper thread: the plan to every rank, then this rank's forward, evaluated."""
        cache_id = self.announce(cache)
        send_plan(StepPlan.forward(op, input_ids, meta, cache_id), self.dist_group.group)
        out = fn(input_ids, positions, meta, cache)
        run_collective(mx.eval, out)
        return out

    def _wait(self, future: Future, timeout: float | None = None) -> Any:
        """The future's result; RankFailedError once a started rank has exited or the deadline passed."""
        timeout = self.step_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=0.1)
            except FutureTimeout:
                pass
            self.dist_group.check_children()
            if time.monotonic() > deadline:
                raise RankFailedError(f"a step took longer than {timeout:.0f} s: a rank is stuck; restart every rank")

    def announce(self, cache: PagedKVCache) -> int:
        """The id the other ranks know `cache` by; a new cache is announced (they allocate pools of
        its size for their KV heads) and gone ones are freed on them."""
        while self._freed:
            send_plan(StepPlan(FREE, cache_id=self._freed.pop()), self.dist_group.group)
        cache_id = self._cache_ids.get(cache)
        if cache_id is None:
            cache_id = next(self._next_cache_id)
            self._cache_ids[cache] = cache_id
            weakref.finalize(cache, self._freed.append, cache_id)
            shape = (cache.num_blocks, cache.block_size, cache.kv_bits)
            send_plan(StepPlan(CACHE, cache_id=cache_id, cache_shape=shape), self.dist_group.group)
        return cache_id

    def stop(self, timeout: float = 10.0) -> None:
        """Tells the other ranks to leave their loops (once; not after a failure)."""
        if self._stopped or self.failed is not None:
            return
        self._stopped = True
        try:
            self._wait(self._pool.submit(send_plan, StepPlan(STOP), self.dist_group.group), timeout)
        except RankFailedError as e:
            log.warning("a rank was gone before the stop: %s", e)


class _StepThread:
    """One daemon thread that runs submitted calls in order. Not a ThreadPoolExecutor: its threads
    are joined at exit, and one stuck in a collective would keep the process from ending."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="tp-step", daemon=True).start()

    def submit(self, fn, *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)


def follow(model: Any, group: Any, watchdog: Watchdog | None = None, files: RankFile | None = None) -> int:
    """A rank other than 0: runs rank 0's forwards on this rank's shard until STOP; returns how
    many it ran; `files`: its prefix cache file. Raises RankFailedError when rank 0 is gone."""
    watchdog = watchdog or Watchdog(STEP_TIMEOUT_S)
    files = files or RankFile(None, None, group.rank(), group.size())
    caches: dict[int, PagedKVCache] = {}
    num_steps = 0
    while True:
        plan = receive_plan(group)  # NOTE: no deadline here: waiting for requests is not a fault
        if plan.op == STOP:
            return num_steps
        if plan.op == CACHE:
            num_blocks, block_size, kv_bits = plan.cache_shape
            caches[plan.cache_id] = PagedKVCache.for_model(model, num_blocks, block_size, kv_bits=kv_bits)
            continue
        if plan.op == FREE:
            caches.pop(plan.cache_id, None)
            continue
        cache = _cache_of(plan, caches, model.args.vocab_size)
        if plan.op in (SAVE, LOAD):
            files.follow(plan, cache, group)
            continue
        meta = plan.metadata(cache.block_size)
        with watchdog.armed("a tensor-parallel step"):
            hidden = model.last_hidden(mx.array(plan.input_ids), meta.positions, meta, cache)
            run_collective(mx.eval, hidden)
        num_steps += 1


def _cache_of(plan: StepPlan, caches: dict[int, PagedKVCache], vocab_size: int) -> PagedKVCache:
    """The cache a plan runs on, once the plan is checked against it (a MessageError otherwise)."""
    cache = caches.get(plan.cache_id)
    if cache is None:
        raise MessageError(f"a step plan names KV cache {plan.cache_id}, which rank 0 never announced")
    plan.check(cache.num_blocks, vocab_size)
    return cache
