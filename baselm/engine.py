"""LLMEngine: requests in, tokens and text out, one scheduled batch per `step`.

The synchronous engine owns the model, the KV pools, the scheduler, the runner and each
request's copies with their output state (copies.py). `add_request` queues a request,
`step` runs one batch and reports what changed, `abort` stops a request. `AsyncEngine`
(async_engine.py) runs it on a thread of its own for the server and the REPL.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from baselm.backend import system_memory_bytes
from baselm.config import EngineConfig
from baselm.copies import Copies, copy_requests
from baselm.kv import PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.loader import LoadedModel
from baselm.request import CompletionOutput, InvalidRequestError
from baselm.runner import Launched, ModelRunner
from baselm.sampling import Sampler, SamplingParams, SamplingRow, TokenLogprobs
from baselm.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats

_DEFAULT_KV_CAP = 2 * 2**30  # bytes; a laptop-friendly ceiling when --kv-memory is not given


class QueueFullError(RuntimeError):
    """Too many requests are already waiting; try again later."""


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
        self.vocab_size = loaded.model.args.vocab_size
        self.cache = self._make_cache(loaded, config)
        self.kv_manager = KVCacheManager(self.cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.copies = Copies(self.tokenizer, self.eos_token_ids)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            check_stop=self.copies.check_stop,
        )
        self.runner = ModelRunner(loaded.model, self.cache, Sampler(self.eos_token_ids, seed=config.seed))
        self.last_step = StepStats()
        self._ids = itertools.count()
        self._inflight: tuple[SchedulerOutput, Launched] | None = None  # a step launched ahead
        self._next_schedule_s = 0.0
        # MLX's CPU backend dispatches while evaluating, so launching ahead overlaps nothing
        # there (measured: mx.async_eval returns after ~85% of a decode step); GPUs run async.
        self._pipeline = config.pipeline_decode if config.pipeline_decode is not None else loaded.backend.is_gpu

    def _make_cache(self, loaded: LoadedModel, config: EngineConfig) -> PagedKVCache:
        model = loaded.model
        num_layers, num_kv_heads, head_dim = model.kv_shape()
        bytes_per_token = PagedKVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, model.dtype, config.kv_bits)
        num_blocks = kv_num_blocks(config, self.max_model_len, bytes_per_token)
        return PagedKVCache.for_model(model, num_blocks, config.block_size, kv_bits=config.kv_bits)

    # ---- requests in -------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a prompt (text or token ids); returns the request id. Raises on requests that can't fit."""
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are already waiting; try again shortly")
        request_id = request_id or self.new_request_id()
        if request_id in self.copies:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((i for i in prompt_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        requests = copy_requests(request_id, prompt_ids, params)
        self.scheduler.add_request(requests[0])  # validates the length for all copies and fills in max_tokens
        self.copies.add(requests)
        return request_id

    # ---- one step ----------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        """NOTE: covers copies still waiting to fork: their parent is queued or running until
        the step it finishes in, and that step adds them (`Copies.start_forks`)."""
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
            outputs += self.copies.collect_aborted(plan.finished_request_ids)
            if plan.is_empty:
                self.last_step = StepStats(schedule=schedule_s)
                return outputs
            launched = self.runner.launch(plan)
        speculation = self._speculate(plan, launched) if self._pipeline else None
        result = self.runner.collect(launched)
        t0 = time.perf_counter()
        self.copies.add_logprobs(result.logprobs)
        updates = self.scheduler.update(plan, result.sampled_token_ids)
        outputs += [self.copies.collect(u.request_id, u.new_token_ids, u.finished, u.finish_reason) for u in updates]
        self.copies.start_forks(self.scheduler)
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
        if launched.sampled is None or self.scheduler.num_waiting or self.copies.has_pending_forks:
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
        outputs = self.copies.collect_aborted(plan.finished_request_ids)
        if not plan.is_empty:
            same = _plan_shape(plan.requests, self.cache.block_size) == expected
            self._inflight = (plan, launched if same else self.runner.launch(plan))
        return outputs

    # ---- requests out ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Stops every copy of a request; its blocks are free before this returns, and the next
        step reports each copy finished with "abort"."""
        self.scheduler.abort(self.copies.abort(request_id))

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
        results = {rid: GenerationResult(rid, self.copies.prompt_token_ids(rid), []) for rid in ids}
        partial: dict[tuple[str, int], Completion] = {}
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
