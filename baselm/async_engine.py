"""AsyncEngine: an LLMEngine on a thread of its own, for the server and the REPL.

The engine thread does all MLX work: it runs commands sent from asyncio code (add, abort,
stats) between steps, steps while anything is unfinished, and hands each output to the
event loop of the request it belongs to. Embedding requests wait in an `EmbeddingQueue`
(embedding.py): the thread runs one slice of them before each step, so they share the
thread with generation instead of holding it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from baselm.embedding import EmbeddingQueue
from baselm.engine import LLMEngine
from baselm.memory import IdleRelease
from baselm.request import AdapterChoice, RequestOutput
from baselm.sampling.params import SamplingParams
from baselm.vision.prompt import PromptImage

log = logging.getLogger("baselm.engine")


def _wait_native_exit(native_id: int | None, deadline: float) -> None:
    """Waits until the OS thread `native_id` of this process has ended (Linux; elsewhere a short pause)."""
    task = f"/proc/self/task/{native_id}"
    if native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


class EngineThreads:
    """Long-lived threads that run engines one after another, for a server that loads and unloads
    models: MLX keeps each thread's stream, with its scheduler thread, after the thread ends, so a
    new thread a load would leave one thread behind each time. A thread whose engine stopped waits
    for the next; there are as many as engines ever ran at once."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def run(self, target: Callable[[], None]) -> threading.Event:
        """Runs `target` on an idle thread (a new one when none is); the event is set once it returned."""
        done = threading.Event()
        with self._lock:
            jobs = self._idle.pop() if self._idle else self._new_thread()
        jobs.put((target, done))
        return done

    def _new_thread(self) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, args=(jobs,), name="base-engine", daemon=True).start()
        return jobs

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            target, done = jobs.get()
            try:
                target()
            finally:
                target = None  # the engine it ran, and its memory, must not wait here for the next
                with self._lock:
                    self._idle.append(jobs)  # first: a load right after this stop takes this thread
                done.set()


def _add_request(
    engine: LLMEngine, prompt: str | Sequence[int], params: SamplingParams, request_id: str, extras: dict[str, Any]
) -> str:
    # NOTE: looked up on the engine, which may be LLMEngine's look-alike (PDEngine)
    return engine.add_request(prompt, params, request_id, **extras)


def _abort(engine: LLMEngine, request_id: str) -> None:
    engine.abort(request_id)


class AsyncEngine:
    """Runs an LLMEngine on a thread of its own, which does all MLX work; asyncio code talks to it.

    `submit` returns an async iterator of RequestOutput; leaving it early (a client
    that disconnects, a cancelled task) aborts the request, whose blocks are then freed
    at the engine's next step.
    """

    def __init__(self, engine: LLMEngine, threads: EngineThreads | None = None):
        """`threads`: run on one of those (reused after this engine stops) instead of a thread of its own."""
        self.engine = engine
        self._threads = threads
        self._done: threading.Event | None = None  # set once `_run` returned on one of `threads`
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # request id -> its reader
        self.embeddings = EmbeddingQueue(engine)  # touched on the engine thread only
        self._thread = threading.Thread(target=self._run, name="base-engine", daemon=True)
        self._stopping = False
        self._wake = threading.Event()
        self._memory = IdleRelease()  # what a burst freed goes back to the OS once idle a moment

    def start(self) -> AsyncEngine:
        if self._threads is not None:
            self._done = self._threads.run(self._run)
        else:
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is in flight and stops the thread.

        NOTE: returns only once the OS thread is gone, not just its Python part: MLX frees
        per-thread state in thread-exit destructors, which must not race interpreter shutdown. On
        `EngineThreads` it returns once the engine's loop has, the thread kept for the next engine.
        """
        self._stopping = True
        self._wake.set()
        if self._done is not None:
            self._done.wait(timeout)
            return
        self._thread.join(timeout)
        _wait_native_exit(self._thread.native_id, deadline=time.monotonic() + timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs `fn(engine, *args)` on the engine thread; returns a concurrent Future (failed at once
        once the engine is stopping: its thread may never read the command)."""
        future: Future = Future()
        if self._stopping:
            future.set_exception(RuntimeError("the engine has stopped"))
            return future
        self._commands.put((fn, args, future))
        self._wake.set()
        return future

    async def run_on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args))

    async def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        images: Sequence[PromptImage] = (),
        adapters: AdapterChoice | None = None,
    ) -> RequestStream:
        """Async iterator over a request's outputs, with the prompt's `images` (`LLMEngine.add_request`),
        run with the LoRA `adapters` (None: the plain model); raises at once if the engine refuses it."""
        params = params or SamplingParams()
        request_id = request_id or self.engine.new_request_id()
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        try:
            # Only what the request has: PDEngine, LLMEngine's look-alike, takes no images.
            extras = {"images": images} if images else {}
            if adapters is not None:
                extras["adapters"] = adapters
            await self.run_on_engine(_add_request, prompt, params, request_id, extras)
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled after the engine took it: nobody would read it
            raise
        return stream

    async def embed(self, inputs: Sequence[Sequence[int]], pooling: str, normalize: bool) -> list[np.ndarray]:
        """One float32 vector per input, computed a slice at a time between the engine's steps;
        raises EmbeddingError at once for inputs that cannot be embedded. Leaving early (a cancelled
        task: a client that disconnects) drops the slices not run yet."""
        request_id = self.engine.new_request_id()
        queue: asyncio.Queue = asyncio.Queue()  # the vectors, or the exception that failed the request
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        item = None
        try:
            await self.run_on_engine(lambda _: self.embeddings.add(request_id, inputs, pooling, normalize))
            item = await queue.get()
        finally:
            self._streams.pop(request_id, None)
            if item is None:  # left before the vectors came: drop the work still queued
                self.call(lambda _: self.embeddings.abort(request_id))
        if isinstance(item, BaseException):
            raise item
        return item

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self.call(_abort, request_id)

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        next_save = time.monotonic() + engine.config.prefix_cache_save_interval
        while not self._stopping:
            self._drain_commands()
            if engine.prefix_file is not None and time.monotonic() >= next_save:
                self._save_prefix_cache()
                next_save = time.monotonic() + engine.config.prefix_cache_save_interval
            ran = self._run_embedding_slice()
            if not engine.has_unfinished:
                if ran:
                    self._memory.busy()
                else:
                    self._memory.idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                continue
            self._memory.busy()
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug: fail the requests in flight, keep serving
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        try:
            self._fail_all(RuntimeError("the engine is shutting down"))
            self._drain_commands()  # those sent before it stopped still get their answer
        finally:
            self._save_prefix_cache()

    def _save_prefix_cache(self) -> None:
        """Saves the prefix cache file when there is one; a failure is logged, never fatal."""
        try:
            self.engine.save_prefix_cache()
        except Exception as exc:  # a full disk must not take the server down
            log.warning("could not save the prefix cache file: %s", exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine, *args))
            except Exception as exc:
                future.set_exception(exc)

    def _run_embedding_slice(self) -> bool:
        """One slice of embedding work before the next step; False when none ran."""
        request = self.embeddings.step()
        if request is None:
            return False
        if request.is_finished:
            self._deliver(request.request_id, request.error or request.vectors)
        return True

    def _deliver(self, request_id: str, item: RequestOutput | list[np.ndarray] | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # its event loop has closed (a server shutting down): nobody is left to read it
            self._streams.pop(request_id, None)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            if request_id in self.embeddings:
                self.embeddings.abort(request_id)
            else:
                self.engine.abort(request_id)
            self._deliver(request_id, exc)


class RequestStream:
    """One request's outputs, as `AsyncEngine.submit` returns them: an async iterator that ends
    once each of the request's n copies has finished.

    NOTE: `aclose` removes the request from the engine's stream table and aborts it unless it
    finished, whether or not iteration ever began (an async generator closed before its first
    step never runs its cleanup, which left a refused multi-prompt request's streams behind).
    """

    def __init__(self, client: AsyncEngine, request_id: str, num_copies: int) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()  # RequestOutputs, or the exception that failed the request
        self.num_unfinished = num_copies
        self.is_closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_closed or not self.num_unfinished:
            await self.aclose()
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        self.num_unfinished -= item.finished
        return item

    async def aclose(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self.client._forget(self.request_id)
        if self.num_unfinished:
            self.client.abort(self.request_id)
