"""The models one server serves: loaded on demand, kept while in use, unloaded when idle.

Every servable model has a `PoolEntry`; a loaded one holds its `ModelState` (its own engine: KV
pool, scheduler, thread). A route asks `ModelPool.acquire` for the model its body names and gets it
under a lease, held until the request's response, stream included, has been sent (`ReleaseLeases`,
an ASGI middleware, gives it back). The rules:

- Loading: the first request for an unloaded model loads it on the pool's worker thread, so the
  event loop keeps serving the other models; requests for it meanwhile wait on the same load, so a burst of first
  requests loads it once. One load runs at a time (memory is counted one model at a time).
- Room: before a load, idle models (no lease) are unloaded, least recently used first, until the
  new one fits `max_loaded` and `memory_budget`. A model under a lease is never unloaded; when
  only such models stand in the way, the load waits for a lease to end. A model alone over the
  budget still loads (there is nothing to evict; it is logged).
- Keep-alive: once a model's last lease ends it stays loaded for its keep-alive (the latest
  request's `keep_alive`, else the entry's default), then unloads; 0 unloads at once, None never.
- A pinned model (an engine handed in already started, as `make_server` does) is never unloaded.
- A loaded model's LoRA adapters (baselm/served_adapters.py) are served under their own names: a
  request naming one leases the model it adapts and gets it as that adapter (`ModelState.for_request`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from baselm.api import request_log
from baselm.api.errors import APIError
from baselm.api.state import ModelState, ServerState

logger = logging.getLogger("baselm.api")

_LEASES = "base.leases"  # the scope key of a request's leases
T = TypeVar("T")
NOT_GIVEN = "not given"  # a request without keep_alive: the model's default applies


@dataclass(frozen=True, slots=True)
class Servable:
    """A model the server may load: the name it answers to, what the loader reads, its expected size."""

    name: str
    ref: str  # a store reference or a path, as `load_model` takes it
    size: int  # bytes it is expected to hold loaded (weights and KV pool); measured once loaded
    aliases: tuple[str, ...] = ()  # other names requests may use (its short name, Ollama's :latest)


class ModelLoader(Protocol):
    """Loads and unloads models for the pool; both run in a worker thread."""

    def catalog(self) -> list[Servable]:
        """Every model the server may serve, read again after the store changed."""
        ...

    def add(self, ref: str) -> None:
        """Serves the store model `ref` too (pulled or copied through the API) when the server
        serves a chosen set; serving the whole store, it is in the next catalog anyway."""
        ...

    def remove(self, ref: str) -> None:
        """Serves `ref` no more (deleted from the store through the API)."""
        ...

    def load(self, servable: Servable, server: ServerState) -> ModelState:
        """The model started: its engine running."""
        ...

    def unload(self, state: ModelState) -> None:
        """Stops the model's engine (saving its prefix cache)."""
        ...

    def free(self) -> None:
        """Gives back the memory of the models unloaded, their last references dropped."""
        ...


@dataclass(slots=True, eq=False)
class PoolEntry:
    """One servable model and what the pool knows of it."""

    servable: Servable
    keep_alive: float | None  # seconds after its last lease ends (None: for ever); the latest request's
    default_keep_alive: float | None
    pinned: bool = False
    state: ModelState | None = None
    loading: asyncio.Future | None = None  # the load in flight
    num_leases: int = 0
    num_loads: int = 0
    last_used: float = 0.0  # monotonic
    size: int = 0  # bytes held while loaded
    expires_at: float | None = None  # wall-clock time it unloads (None: not while loaded, or never)
    timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.servable.name

    @property
    def status(self) -> str:
        """llama-server's words: "loaded", "loading" or "unloaded"."""
        return "loaded" if self.state is not None else "loading" if self.loading is not None else "unloaded"


@dataclass(slots=True)
class PoolLimits:
    """When the pool unloads: the default keep-alive, the most models loaded, the memory budget."""

    keep_alive: float | None = 300.0  # seconds (None: for ever)
    max_loaded: int = 0  # 0: no limit
    memory_budget: int = 0  # bytes; 0: no limit


class ModelPool:
    """The servable models, loaded and unloaded by the rules in the module docstring."""

    def __init__(self, server: ServerState, loader: ModelLoader | None, limits: PoolLimits | None = None) -> None:
        self.server = server
        self.loader = loader
        self.limits = limits or PoolLimits()
        self.entries: dict[str, PoolEntry] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._released = asyncio.Event()  # set when a lease ends: a waiting load looks again
        self.worker = PoolWorker()

    # ---- the models --------------------------------------------------------------------------

    def add(self, servable: Servable, keep_alive: float | None = None, *, default: bool = True) -> PoolEntry:
        """Serves `servable` (again: its entry kept when loaded). `default`: the limits' keep-alive."""
        entry = self.entries.get(servable.name)
        if entry is None:
            ka = self.limits.keep_alive if default else keep_alive
            entry = self.entries[servable.name] = PoolEntry(servable, ka, ka, size=servable.size)
        entry.servable = servable
        return entry

    def pin(self, state: ModelState, servable: Servable) -> PoolEntry:
        """Serves an already started model that is never unloaded (`make_server`'s)."""
        entry = self.add(servable, None, default=False)
        entry.pinned, entry.state, entry.last_used = True, state, time.monotonic()
        return entry

    async def refresh(self) -> None:
        """Reads the loader's catalog again (after a pull, a copy or a delete): new models are
        servable at once; a model gone from it stops being servable once it is idle."""
        if self.loader is None:
            return
        catalog = await asyncio.to_thread(self.loader.catalog)  # the store's files alone, no MLX
        names = {s.name for s in catalog}
        for servable in catalog:
            self.add(servable)
        for entry in list(self.entries.values()):
            if entry.name in names or entry.pinned:
                continue
            if entry.state is None or await self.unload(entry):
                self.entries.pop(entry.name, None)  # in use: kept until a later reading finds it idle

    def find(self, name: str) -> PoolEntry | None:
        """The entry `name` names: its own name, an alias, either with Ollama's ":latest", or the name
        of a loaded model's adapter (its entry is that model's)."""
        for candidate in dict.fromkeys((name, name.removesuffix(":latest"))):
            if candidate in self.entries:
                return self.entries[candidate]
            matches = [e for e in self.entries.values() if candidate in e.servable.aliases]
            if len(matches) == 1:
                return matches[0]
            adapted = next((e for e in self.loaded() if candidate in adapter_names(e)), None)
            if adapted is not None:
                return adapted
        return None

    def names(self) -> list[str]:
        return sorted(self.entries)

    def loaded(self) -> list[PoolEntry]:
        return [e for e in self.entries.values() if e.state is not None]

    def unknown(self, name: str) -> APIError:
        """The 404 of a model this server does not serve, naming those it does (adapters among them)."""
        names = self.names() + [a for e in self.loaded() for a in adapter_names(e)]
        served = ", ".join(repr(n) for n in names) or "none"
        return APIError(404, f"model {name!r} not found; this server serves {served}", "model", "model_not_found")

    # ---- leases ------------------------------------------------------------------------------

    async def acquire(self, scope: Scope, name: str, keep_alive: float | str | None = NOT_GIVEN) -> ModelState:
        """The loaded model `name` names, as that name asks for it (`ModelState.for_request`: an
        adapter's name runs the adapter), under a lease that ends with the request (404 when unknown).
        `keep_alive`: the request's (seconds; None: for ever), else the model's default."""
        entry = await self.lookup(name)
        state = await self.wait_loaded(entry)
        entry.num_leases += 1
        self._touch(entry)
        self._set_keep_alive(entry, keep_alive)
        scope.setdefault(_LEASES, []).append(entry)
        state = state.for_request(name)
        record = request_log.of(scope)
        if record is not None:
            record.model = state.model_name
        return state

    async def lookup(self, name: str) -> PoolEntry:
        """The entry `name` names, the catalog read again when none does yet; a 404 when still none."""
        entry = self.find(name)
        if entry is None:
            await self.refresh()  # pulled, copied or imported since
            entry = self.find(name)
        if entry is None:
            raise self.unknown(name)
        return entry

    async def wait_loaded(self, entry: PoolEntry) -> ModelState:
        """`entry`'s state, loading it first when it is not loaded (one load for every waiter).

        NOTE: the caller takes its lease (or starts the keep-alive) before it next awaits: between
        the load's end and that, nothing may unload the model."""
        while entry.state is None:
            if entry.loading is None:
                entry.loading = asyncio.ensure_future(self._load(entry))
                entry.loading.add_done_callback(lambda _: self._if_unclaimed(entry))
            await asyncio.shield(entry.loading)  # a waiter that leaves does not cancel the others' load
        return entry.state

    def _if_unclaimed(self, entry: PoolEntry) -> None:
        """After a load: when every waiter left, nobody takes a lease, so the keep-alive starts now
        (looked at once the waiters have run)."""
        asyncio.get_running_loop().call_soon(self._start_unclaimed_keep_alive, entry)

    def _start_unclaimed_keep_alive(self, entry: PoolEntry) -> None:
        if entry.num_leases == 0 and entry.timer is None:
            self._start_keep_alive(entry)

    def release(self, entry: PoolEntry) -> None:
        """Ends one lease; the last one starts the model's keep-alive."""
        entry.num_leases -= 1
        self._touch(entry)
        self._released.set()
        if entry.num_leases == 0:
            self._start_keep_alive(entry)

    def _set_keep_alive(self, entry: PoolEntry, keep_alive: float | str | None) -> None:
        """As Ollama: each request sets how long its model stays loaded after it; one that says
        nothing, the model's default."""
        entry.keep_alive = entry.default_keep_alive if keep_alive == NOT_GIVEN else keep_alive  # type: ignore[assignment]

    def _touch(self, entry: PoolEntry) -> None:
        entry.last_used = time.monotonic()
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None

    def _start_keep_alive(self, entry: PoolEntry) -> None:
        if entry.pinned or entry.state is None or entry.keep_alive is None:
            return
        if entry.keep_alive <= 0:
            asyncio.ensure_future(self.unload(entry))
            return
        entry.expires_at = time.time() + entry.keep_alive
        entry.timer = asyncio.get_running_loop().call_later(
            entry.keep_alive, lambda: asyncio.ensure_future(self.unload(entry))
        )

    # ---- loading and unloading ---------------------------------------------------------------

    async def _load(self, entry: PoolEntry) -> None:
        try:
            async with self._lock:
                if entry.state is not None:
                    return
                if self.loader is None:
                    raise APIError(503, f"model {entry.name!r} is not loaded and this server cannot load it")
                await self._make_room(entry)
                started = time.monotonic()
                try:
                    state = await self.worker.run(self.loader.load, entry.servable, self.server)
                except Exception as exc:
                    logger.exception("loading %s failed", entry.name, exc_info=exc)
                    raise APIError(500, f"model {entry.name!r} could not be loaded: {exc}") from None
                entry.state, entry.num_loads = state, entry.num_loads + 1
                entry.size = loaded_size(state)
                self._touch(entry)
                logger.info("loaded %s in %.2f s (%d MiB)", entry.name, time.monotonic() - started, entry.size >> 20)
        finally:
            entry.loading = None

    async def _make_room(self, entry: PoolEntry) -> None:
        """Unloads idle models, least recently used first, until `entry` fits; waits while only
        models in use stand in the way. NOTE: runs under the pool's lock."""
        while True:
            others = [e for e in self.loaded() if e is not entry]
            if self._fits(entry, others):
                return
            idle = [e for e in others if e.num_leases == 0 and not e.pinned]
            if idle:
                await self._unload_locked(min(idle, key=lambda e: e.last_used))
                continue
            if not [e for e in others if not e.pinned]:
                logger.warning("loading %s beyond the limits: nothing else can be unloaded", entry.name)
                return
            self._released.clear()
            await self._released.wait()

    def _fits(self, entry: PoolEntry, others: list[PoolEntry]) -> bool:
        limits = self.limits
        if limits.max_loaded and len(others) + 1 > limits.max_loaded:
            return False
        return not limits.memory_budget or sum(e.size for e in others) + entry.size <= limits.memory_budget

    async def unload(self, entry: PoolEntry) -> bool:
        """Unloads `entry` unless it is in use or pinned; True when it was unloaded."""
        async with self._lock:
            return await self._unload_locked(entry)

    async def _unload_locked(self, entry: PoolEntry) -> bool:
        if entry.state is None or entry.num_leases or entry.pinned or self.loader is None:
            return False
        state, entry.state = entry.state, None
        self._touch(entry)
        await self.worker.run(self.loader.unload, state)
        del state  # NOTE: the last reference to its engine, weights and KV pool, before the memory is freed
        await self.worker.run(self.loader.free)
        logger.info("unloaded %s", entry.name)
        return True

    async def load(self, entry: PoolEntry, keep_alive: float | str | None = NOT_GIVEN) -> ModelState:
        """Loads `entry` without a request's lease (an empty Ollama request, POST /models/load); its
        keep-alive starts at once."""
        self._set_keep_alive(entry, keep_alive)
        state = await self.wait_loaded(entry)
        if entry.num_leases == 0:
            self._touch(entry)
            self._start_keep_alive(entry)
        return state

    def stop(self, stop_client: Callable[[ModelState], None]) -> None:
        """Stops every loaded model's engine (at shutdown), pinned ones too, then the worker."""
        for entry in self.loaded():
            stop_client(entry.state)  # type: ignore[arg-type]
        self.worker.stop()

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter(sorted(self.entries.values(), key=lambda e: e.name))


class PoolWorker:
    """The one thread that loads and frees the pool's models, for the server's life.

    NOTE: one thread, not one per load nor asyncio's pool: MLX gives every thread that touches it
    a stream and a scheduler thread of its own, which outlive it; `stop` ends this thread while
    the interpreter is alive (its MLX state must not be freed in the interpreter's teardown)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker, off the event loop; its result or its exception."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="base-pool", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting task
                future.set_exception(exc)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(60)
            self._thread = None


def loaded_size(state: ModelState) -> int:
    """Bytes a loaded model holds: its weights and its KV pool."""
    from mlx.utils import tree_flatten

    engine = state.client.engine
    weights = sum(v.nbytes for _, v in tree_flatten(engine.loaded.model.parameters()))
    cache = getattr(engine, "cache", None)
    return weights + (cache.nbytes if cache is not None else 0)


def adapter_names(entry: PoolEntry) -> list[str]:
    """The names of the LoRA adapters a loaded entry's model serves."""
    served = entry.state.served_adapters if entry.state is not None else None
    return served.names if served is not None else []


def pool_of(request: Request) -> ModelPool:
    """The pool of the app a request came to (`create_app` puts it there)."""
    return request.app.state.pool


class ReleaseLeases:
    """Ends a request's model leases once its response, stream included, is sent or abandoned."""

    def __init__(self, app: ASGIApp, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for entry in scope.pop(_LEASES, []):
                self.pool.release(entry)
