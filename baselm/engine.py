"""LLMEngine: requests in, tokens and text out, one scheduled batch per `step`.

The synchronous engine owns the model, the KV pools, the scheduler and the sampler.
`AsyncEngine` runs it on a thread of its own for the server and the REPL.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from baselm.backend import system_memory_bytes
from baselm.config import EngineConfig
from baselm.kv import PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.loader import LoadedModel
from baselm.request import InvalidRequestError, Request
from baselm.runner import Launched, ModelRunner
from baselm.sampling import Sampler, SamplingParams, SamplingRow, TokenLogprobs
from baselm.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats
from baselm.stop import StopChecker

_DEFAULT_KV_CAP = 2 * 2**30  # bytes; a laptop-friendly ceiling when --kv-memory is not given


class QueueFullError(RuntimeError):
    """Too many requests are already waiting; try again later."""


@dataclass(slots=True)
class CompletionOutput:
    """What one step produced for one copy (`index`) of a request."""

    request_id: str
    index: int
    text: str  # new text, safe to show (held-back stop-string prefixes excluded)
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Completion:
    """A finished copy of a request, as `generate` returns it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0


@dataclass(slots=True)
class StepStats:
    """Seconds per part of the last step, and what it did."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0


class _Sequence:
    """Per-copy output state: detokenizer, stop checker, text and logprobs not yet reported."""

    __slots__ = ("request", "group_id", "index", "detokenizer", "stop", "text", "logprobs", "stop_reason")

    def __init__(self, request: Request, group_id: str, index: int, detokenizer, stop: StopChecker):
        self.request = request
        self.group_id = group_id
        self.index = index
        self.detokenizer = detokenizer
        self.stop = stop
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.stop_reason: int | str | None = None


def _plan_shape(requests, block_size: int) -> tuple:
    """What a decode step's graph depends on: each request, its context, the blocks it uses."""
    shape = []
    for s in requests:
        if s.num_scheduled_tokens != 1 or not s.is_sampling:
            return ()
        shape.append((s.request_id, s.context_len, tuple(s.block_ids[: -(-s.context_len // block_size)])))
    return tuple(shape)


def kv_num_blocks(config: EngineConfig, max_model_len: int, bytes_per_token: int) -> int:
    """Blocks for the pools: `kv_memory` when given, else enough for max_num_seqs full contexts
    up to a ceiling of min(2 GiB, a fifth of system memory)."""
    if config.kv_memory is not None:
        budget = config.kv_memory
    else:
        system = system_memory_bytes() or 8 * 2**30
        wanted = config.max_num_seqs * max_model_len * bytes_per_token
        budget = min(wanted, _DEFAULT_KV_CAP, system // 5)
    return max(1, budget // (bytes_per_token * config.block_size))


class LLMEngine:
    """Synchronous engine: `add_request`, then `step` until done; `generate` does both."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        model = loaded.model
        self.vocab_size = model.args.vocab_size
        num_layers, num_kv_heads, head_dim = model.kv_shape()
        dtype = model.dtype
        bytes_per_token = PagedKVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, config.kv_bits)
        num_blocks = kv_num_blocks(config, self.max_model_len, bytes_per_token)
        self.cache = PagedKVCache(
            num_layers, num_blocks, config.block_size, num_kv_heads, head_dim, dtype, kv_bits=config.kv_bits
        )
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            check_stop=self._check_stop,
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.runner = ModelRunner(model, self.cache, self.sampler)
        self.last_step = StepStats()
        self._seqs: dict[str, _Sequence] = {}  # internal request id -> its output state
        self._groups: dict[str, list[str]] = {}  # user request id -> internal ids of its copies
        self._pending_forks: dict[str, list[Request]] = {}  # parent id -> copies waiting for its prompt
        self._ids = itertools.count()
        self._inflight: tuple[SchedulerOutput, Launched] | None = None  # a step launched ahead
        self._next_schedule_s = 0.0
        # MLX's CPU backend dispatches while evaluating, so launching ahead overlaps nothing
        # there (measured: mx.async_eval returns after ~85% of a decode step); GPUs run async.
        self._pipeline = config.pipeline_decode if config.pipeline_decode is not None else loaded.backend.is_gpu

    # ---- requests in -------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a prompt (text or token ids); returns the request id. Raises on requests that can't fit."""
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are already waiting; try again shortly")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((i for i in prompt_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        requests = [Request(request_id, prompt_ids, params)]
        requests += [Request(f"{request_id}#{i}", prompt_ids, params.for_copy(i)) for i in range(1, params.n)]
        self.scheduler.add_request(requests[0])  # validates the length for all copies and fills in max_tokens
        copies = [self._make_sequence(request_id, i, r, requests[0].max_tokens) for i, r in enumerate(requests)]
        self._groups[request_id] = [s.request.request_id for s in copies]
        for seq in copies:
            self._seqs[seq.request.request_id] = seq
        if params.n > 1:
            self._pending_forks[copies[0].request.request_id] = [s.request for s in copies[1:]]
        return request_id

    def _make_sequence(self, group_id: str, index: int, request: Request, max_tokens: int) -> _Sequence:
        request.max_tokens = max_tokens
        params = request.sampling_params
        stop = StopChecker(params, self.eos_token_ids, max_tokens=max_tokens)
        detokenizer = self.tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
        return _Sequence(request, group_id, index, detokenizer, stop)

    def abort(self, request_id: str) -> None:
        """Stops every copy of a request; its blocks are free before this returns."""
        for internal_id in self._groups.get(request_id, []):
            self._pending_forks.pop(internal_id, None)
            self.scheduler.abort([internal_id])

    # ---- one step ----------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        """NOTE: covers copies still waiting to fork: their parent is queued or running until
        the step it finishes in, and that step adds them (`_start_pending_forks`)."""
        return self.scheduler.has_unfinished

    def step(self) -> list[CompletionOutput]:
        """Schedules, runs the model once, samples, and reports what changed for each request.

        With decode pipelining (on GPUs by default), a decoding batch launches its next step
        on the device-side sampled ids before reading them back, so building that step's
        graph overlaps this step's compute (see `_speculate`).
        """
        outputs: list[CompletionOutput] = []
        if self._inflight is not None:
            plan, launched = self._inflight
            self._inflight = None
            schedule_s = self._next_schedule_s
        else:
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            schedule_s = time.perf_counter() - t0
            outputs += self._report_aborted(plan)
            if plan.is_empty:
                self.last_step = StepStats(schedule=schedule_s)
                return outputs
            launched = self.runner.launch(plan)
        speculation = self._speculate(plan, launched) if self._pipeline else None
        result = self.runner.collect(launched)
        t0 = time.perf_counter()
        for request_id, logprobs in result.logprobs.items():
            self._seqs[request_id].logprobs.append(logprobs)
        updates = self.scheduler.update(plan, result.sampled_token_ids)
        outputs += [self._collect(u.request_id, u.new_token_ids, u.finished, u.finish_reason) for u in updates]
        self._start_pending_forks()
        update_s = time.perf_counter() - t0
        if speculation is not None:
            outputs += self._adopt(*speculation)
        timings = self.runner.timings
        self.last_step = StepStats(
            schedule=schedule_s,
            prepare=timings.prepare,
            forward=timings.forward,
            sample=timings.sample,
            update=update_s,
            num_tokens=plan.num_scheduled_tokens,
            num_seqs=len(plan.requests),
        )
        return outputs

    def _speculate(self, plan: SchedulerOutput, launched: Launched) -> tuple[tuple, Launched] | None:
        """Launches the step after `plan` before its sampled ids are read, when that step is
        predictable: every request decoding one token, none about to reach max_tokens, nobody
        waiting, and no sampling option that needs the new token on the host (processors,
        penalties, top-k/top-p). Returns the step's expected shape and the launched step."""
        if launched.sampled is None or self.scheduler.num_waiting or self._pending_forks:
            return None
        for scheduled in plan.requests:
            request, params = scheduled.request, scheduled.request.sampling_params
            if scheduled.num_scheduled_tokens != 1 or not scheduled.is_sampling or request.is_finished:
                return None  # aborted while launched: it must not get blocks again
            if params.logits_processors or params.has_penalties or request.num_output_tokens + 1 >= request.max_tokens:
                return None
            if not params.greedy and (0 < params.top_k < self.vocab_size or params.top_p < 1.0):
                return None
        spec, seqs = [], []
        for scheduled in plan.requests:
            request = scheduled.request
            # The next step's block; the real schedule finds it already allocated.
            if not self.kv_manager.allocate_slots(request, 2):
                return None
            table = list(self.kv_manager.block_table(request))
            spec.append(ScheduledRequest(request, [0], request.num_computed_tokens + 1, table, True, False))
            seqs.append(SamplingRow(request.sampling_params, request.prompt_token_ids, [*request.output_token_ids, 0]))
        expected = _plan_shape(spec, self.cache.block_size)
        spec_plan = SchedulerOutput(requests=spec, num_scheduled_tokens=len(spec))
        return expected, self.runner.launch(spec_plan, input_ids=launched.sampled.token_ids, seqs=seqs)

    def _adopt(self, expected: tuple, launched: Launched) -> list[CompletionOutput]:
        """Schedules the next step for real; keeps the speculative launch if it is that step.

        NOTE: a discarded launch only wrote, for requests still running, the same K/V the
        real step writes again, and for finished ones into freed blocks that nothing reads
        before the real step, which runs after it on the same stream.
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._next_schedule_s = time.perf_counter() - t0
        outputs = self._report_aborted(plan)
        if not plan.is_empty:
            same = _plan_shape(plan.requests, self.cache.block_size) == expected
            self._inflight = (plan, launched if same else self.runner.launch(plan))
        return outputs

    def _check_stop(self, request: Request) -> str | None:
        """Scheduler callback after each appended token: detokenize, match stops, keep the text."""
        seq = self._seqs[request.request_id]
        token_id = request.output_token_ids[-1]
        update = seq.stop.update(token_id, seq.detokenizer.add(token_id))
        seq.text += update.text
        if update.finish_reason == "length":
            seq.text += seq.detokenizer.finish()
        seq.stop_reason = update.stop_reason
        return update.finish_reason

    def _collect(self, internal_id: str, token_ids: list[int], finished: bool, reason: str | None) -> CompletionOutput:
        seq = self._seqs[internal_id]
        request = seq.request
        out = CompletionOutput(
            request_id=seq.group_id,
            index=seq.index,
            text=seq.text,
            token_ids=list(token_ids),
            logprobs=seq.logprobs,
            finished=finished,
            finish_reason=reason,
            stop_reason=seq.stop_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
        seq.text, seq.logprobs = "", []
        if finished:
            self._forget(internal_id)
        return out

    def _report_aborted(self, plan: SchedulerOutput) -> list[CompletionOutput]:
        outputs = []
        for internal_id in plan.finished_request_ids:
            seq = self._seqs.get(internal_id)
            if seq is not None and seq.request.is_finished and seq.request.finish_reason == "abort":
                outputs.append(self._collect(internal_id, [], True, "abort"))
        return outputs

    def _forget(self, internal_id: str) -> None:
        seq = self._seqs.pop(internal_id)
        group = self._groups.get(seq.group_id)
        if group is not None and all(i not in self._seqs for i in group):
            del self._groups[seq.group_id]

    def _start_pending_forks(self) -> None:
        """Copies of an n > 1 request start once the parent's prompt is in the cache, sharing its blocks."""
        for parent_id in list(self._pending_forks):
            parent = self._seqs.get(parent_id)
            if parent is not None and parent.request.num_output_tokens == 0 and not parent.request.is_finished:
                continue  # prompt not computed yet
            for child in self._pending_forks.pop(parent_id):
                if parent is not None and not parent.request.is_finished:
                    self.scheduler.fork_request(parent_id, child)
                else:  # the parent already finished: its freed blocks are still prefix-cache hits
                    self.scheduler.add_request(child)

    # ---- convenience -------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[CompletionOutput]:
        """Runs one request to the end, yielding its outputs (other queued requests run too)."""
        request_id = self.add_request(prompt, params)
        remaining = (params or SamplingParams()).n
        while remaining:
            for out in self.step():
                if out.request_id == request_id:
                    remaining -= out.finished
                    yield out

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Runs all prompts together (continuous batching) and returns them in order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {rid: GenerationResult(rid, [], []) for rid in ids}
        partial: dict[tuple[str, int], Completion] = {}
        for rid in ids:
            results[rid].prompt_token_ids = list(self._seqs[rid].request.prompt_token_ids)
        while self.has_unfinished:
            for out in self.step():
                if out.request_id not in results:
                    continue
                c = partial.setdefault((out.request_id, out.index), Completion(out.index, "", [], [], None, None))
                c.text += out.text
                c.token_ids += out.token_ids
                c.logprobs += out.logprobs
                results[out.request_id].num_cached_tokens = max(
                    results[out.request_id].num_cached_tokens, out.num_cached_tokens
                )
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                    results[out.request_id].completions.append(c)
        for result in results.values():
            result.completions.sort(key=lambda c: c.index)
        return [results[rid] for rid in ids]

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()


def _wait_native_exit(native_id: int | None, deadline: float) -> None:
    """Waits until the OS thread `native_id` of this process has ended (Linux; elsewhere a short pause)."""
    task = f"/proc/self/task/{native_id}"
    if native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


class AsyncEngine:
    """Runs an LLMEngine on a thread of its own, which does all MLX work; asyncio code talks to it.

    `submit` returns an async iterator of CompletionOutput; leaving it early (a client
    that disconnects, a cancelled task) aborts the request, whose blocks are then freed
    at the engine's next step.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple] = {}  # request id -> (event loop, asyncio.Queue)
        self._thread = threading.Thread(target=self._run, name="base-engine", daemon=True)
        self._stopping = False
        self._wake = threading.Event()

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is in flight and stops the thread.

        NOTE: returns only once the OS thread is gone, not just its Python part: MLX frees
        per-thread state in thread-exit destructors, which must not race interpreter shutdown.
        """
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        _wait_native_exit(self._thread.native_id, deadline=time.monotonic() + timeout)

    def call(self, fn, *args):
        """Runs `fn(engine, *args)` on the engine thread; returns a concurrent Future."""
        future: Future = Future()
        self._commands.put((fn, args, future))
        self._wake.set()
        return future

    async def run_on_engine(self, fn, *args):
        return await asyncio.wrap_future(self.call(fn, *args))

    async def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ):
        """Async iterator over a request's outputs; raises at once if the engine refuses it."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self.engine._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            await self.run_on_engine(LLMEngine.add_request, prompt, params, request_id)
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled after the engine took it: nobody would read it
            raise
        return self._iterate(request_id, stream, params.n)

    async def _iterate(self, request_id: str, stream, num_copies: int):
        remaining = num_copies
        try:
            while remaining:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.call(LLMEngine.abort, request_id)

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_commands()
            if not engine.has_unfinished:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug: fail the requests in flight, keep serving
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        self._fail_all(RuntimeError("the engine is shutting down"))

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

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._deliver(request_id, exc)
