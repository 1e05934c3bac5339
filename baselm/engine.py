"""LLMEngine: requests in, tokens and text out, one scheduled batch per `step`.

The synchronous engine owns the model, the KV pools, the scheduler, the runner and the output
processor (outputs.py: each request's text, stops and logprobs, and the copies of an n > 1
request). `add_request` queues a request, `step` runs one batch and reports what changed
(`update` applies its results), `abort` stops a request. `AsyncEngine` (async_engine.py)
runs it on a thread of its own for the server and the REPL. With `config.speculative`, a
`Speculator` (baselm/speculative/) proposes tokens before each step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from baselm.config import EngineConfig
from baselm.kv import PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.kv.persist import PersistentPrefixCache
from baselm.kv.sizing import kv_pool_size
from baselm.loader import LoadedModel, load_model
from baselm.outputs import OutputProcessor, copy_requests
from baselm.request import AdapterChoice, InvalidRequestError, RequestOutput
from baselm.runner import Launched, ModelRunner, RunnerOutput, StepStats
from baselm.sampling.params import SamplingParams
from baselm.sampling.sampler import Sampler
from baselm.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from baselm.speculative.draft import DraftModelProposer, check_same_vocabulary
from baselm.speculative.speculator import SpecStats, Speculator
from baselm.vision import ImageError, ImageProcessor, PromptImage, image_processor


class QueueFullError(RuntimeError):
    """Too many requests are already waiting; try again later."""


@dataclass(slots=True)
class GenerationResult:
    """One prompt's whole answer, as `generate` returns it: each copy's outputs merged into one."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[RequestOutput]  # by copy index
    num_cached_tokens: int = 0


def make_scheduler(kv: KVCacheManager, config: EngineConfig, max_model_len: int) -> Scheduler:
    """The scheduler an engine's config asks for, over `kv`'s blocks."""
    return Scheduler(
        kv,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
    )


def make_cache(loaded: LoadedModel, config: EngineConfig) -> tuple[PagedKVCache, int]:
    """The KV pool `config` asks for over `loaded` (sized by `baselm.kv.sizing`), and the context
    every request must fit in: the config's or the model's, shortened where the default pool is."""
    model = loaded.model
    num_layers, num_kv_heads, head_dim = model.kv_shape()
    per_token = PagedKVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, model.dtype, config.kv_bits)
    max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
    size = kv_pool_size(config, max_model_len, per_token, loaded.backend.memory_bytes())
    cache = PagedKVCache.for_model(model, size.num_blocks, config.block_size, kv_bits=config.kv_bits)
    return cache, size.max_model_len


def _image_support(loaded: LoadedModel) -> tuple[ImageProcessor | None, str | None]:
    """The model's image processor, or (None, why it takes no images): it reads text only, or its
    tokenizer lacks the image tokens its config names (its text still runs)."""
    try:
        processor = image_processor(loaded.config, loaded.tokenizer)
    except ImageError as exc:
        return None, f"cannot take images: {exc}"
    return processor, None if processor is not None else "reads text only; it cannot take images"


class LLMEngine:
    """Synchronous engine: `add_request`, then `step` until done; `generate` does both."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, draft: LoadedModel | None = None):
        """`draft`: the draft model for `config.speculative` with method "draft", when already
        loaded; otherwise the engine loads `config.speculative.draft_model`."""
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.cache, self.max_model_len = make_cache(loaded, config)
        self.vocab_size = loaded.model.args.vocab_size
        self.kv_manager = KVCacheManager(self.cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prefix_file = self._open_prefix_file(loaded, config)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.runaway_guard)
        self.scheduler = make_scheduler(self.kv_manager, config, self.max_model_len)
        self.runner = ModelRunner(loaded.model, self.cache, Sampler(self.eos_token_ids, seed=config.seed))
        # None: the model takes no images, and `image_refusal` says why (after its name, in a sentence)
        self.image_processor, self.image_refusal = _image_support(loaded)
        self.last_step = StepStats()
        self._ids = itertools.count()
        self._inflight: tuple[SchedulerOutput, Launched] | None = None  # a step launched ahead
        self._next_schedule_s = 0.0
        # MLX's CPU backend dispatches while evaluating, so launching ahead overlaps nothing
        # there (measured: mx.async_eval returns after ~85% of a decode step); GPUs run async.
        self._pipeline = config.pipeline_decode if config.pipeline_decode is not None else loaded.backend.is_gpu
        self.speculator = self._make_speculator(draft) if config.speculative is not None else None
        if self.speculator is not None:
            self._pipeline = False  # a step's drafts depend on the tokens the step before it emitted

    def _make_speculator(self, draft: LoadedModel | None) -> Speculator:
        spec = self.config.speculative
        proposer = None
        if spec.method == "draft":
            draft = draft or load_model(spec.draft_model, self.loaded.backend)
            check_same_vocabulary(draft, self.loaded)
            proposer = DraftModelProposer(draft, self.cache.num_blocks, self.config.block_size, self.config.seed)
        speculator = Speculator(spec, proposer, self.config.max_num_batched_tokens)
        if spec.adaptive:
            most = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * (spec.num_speculative_tokens + 1))
            speculator.calibrate(self.loaded.model, self.cache, self.kv_manager, most)
        return speculator

    def _open_prefix_file(self, loaded: LoadedModel, config: EngineConfig) -> PersistentPrefixCache | None:
        """The prefix cache file, its blocks loaded into the pool; None without one."""
        if not config.prefix_cache_file:
            return None
        open_file = getattr(loaded.model, "open_prefix_cache", PersistentPrefixCache.open)  # a group's: one per rank
        # LoRA adapters (one process alone: they are refused over several) are part of the K/V's identity.
        adapters = {"adapters": [(a.path, a.scale) for a in loaded.adapters]} if loaded.adapters else {}
        return open_file(
            config.prefix_cache_file, loaded.path, self.kv_manager, self.cache, config.prefix_cache_max_size, **adapters
        )

    def save_prefix_cache(self) -> int | None:
        """Writes the prefix cache file if there is one and the cache changed; returns blocks written."""
        return self.prefix_file.save() if self.prefix_file is not None else None

    # ---- requests in -------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        images: Sequence[PromptImage] = (),
        adapters: AdapterChoice | None = None,
    ) -> str:
        """Queues a prompt (text or token ids); returns the request id. Raises on requests that can't fit.
        `images`: the prompt's images (`baselm.vision.place_images`), for a model with a vision tower;
        `adapters`: the LoRA adapters of the model's served ones it runs with (`loaded.served_adapters`;
        None: the plain model)."""
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        if adapters is not None:
            self._check_adapters(adapters)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are already waiting; try again shortly")
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((i for i in prompt_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        if images:
            self._check_images(images)
        requests = copy_requests(request_id, prompt_ids, params, images, adapters)
        self.scheduler.add_request(requests[0])  # validates the length for all copies and fills in max_tokens
        self.output_processor.add(requests)
        return request_id

    def _check_images(self, images: Sequence[PromptImage]) -> None:
        """Images need a vision model, and one computed whole (two-way attention) must fit a step."""
        if self.image_processor is None:
            raise InvalidRequestError(f"model {self.loaded.name} {self.image_refusal}")
        whole = max((i.num_tokens for i in images if i.bidirectional), default=0)
        if whole > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"an image takes {whole} tokens, computed in one step, but a step computes at most "
                f"{self.config.max_num_batched_tokens} (max_num_batched_tokens)"
            )

    def _check_adapters(self, adapters: AdapterChoice) -> None:
        served = self.loaded.served_adapters
        if served is None:
            raise InvalidRequestError(f"{self.loaded.name} serves no LoRA adapters (base serve MODEL --lora NAME=PATH)")
        try:
            served.check(slot for slot, _ in adapters.slots)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    # ---- one step ----------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        """NOTE: covers copies still waiting to fork: their parent is queued or running until
        the step it finishes in, and that step adds them (`OutputProcessor.start_forks`)."""
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, samples, and reports what changed for each request.

        With decode pipelining (on GPUs by default), a decoding batch launches its next step
        on the device-side sampled ids before reading them back, so building that step's
        graph overlaps this step's compute (see `_launch_ahead`).
        """
        outputs: list[RequestOutput] = []
        if self._inflight is not None:
            plan, launched = self._inflight
            self._inflight = None
            schedule_s = self._next_schedule_s
        else:
            t0 = time.perf_counter()
            if self.speculator is not None:
                self.speculator.propose(self.scheduler)
            plan = self.scheduler.schedule()
            schedule_s = time.perf_counter() - t0
            outputs += self.output_processor.collect_aborted(plan.finished_request_ids)
            if plan.is_empty:
                self.last_step = StepStats(schedule=schedule_s)
                return outputs
            launched = self.runner.launch(plan)
        ahead = self._launch_ahead(plan, launched) if self._pipeline else None
        result = self.runner.collect(launched)
        t0 = time.perf_counter()
        outputs += self.update(plan, result)
        self.output_processor.start_forks(self.scheduler)
        if self.speculator is not None:
            step = self.runner.last_step
            self.speculator.observe(plan, result, step.forward + step.sample, self.scheduler)
        update_s = time.perf_counter() - t0
        if ahead is not None:
            outputs += self._schedule_after_ahead(*ahead)
        self.last_step = replace(
            self.runner.last_step,
            schedule=schedule_s,
            update=update_s,
            num_tokens=plan.num_scheduled_tokens,
            num_seqs=len(plan.requests),
        )
        return outputs

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Applies a finished step's results: the output processor decides which requests stopped
        and why, the scheduler appends the kept ids and frees the stopped requests, and each output
        is completed for its user. NOTE: the stop decision goes one way, never back."""
        stops = self.output_processor.process(plan, result)
        updates = self.scheduler.update(plan, stops.token_ids, stops.finish_reasons)
        return [self.output_processor.complete(out) for out in updates]

    def _launch_ahead(self, plan: SchedulerOutput, launched: Launched) -> tuple[SchedulerOutput, Launched] | None:
        """Launches the step the scheduler plans after `plan` (`Scheduler.schedule_ahead`) on the
        sampled ids still on the device, when no copy is about to fork and no request's sampling
        needs its newest id on the host. Returns that plan and its launch."""
        if launched.sampled is None or self.output_processor.has_pending_forks:
            return None
        if any(s.request.sampling_params.needs_host_ids(self.vocab_size) for s in plan.requests):
            return None
        ahead = self.scheduler.schedule_ahead(plan)
        return None if ahead is None else (ahead, self.runner.launch(ahead, after=launched))

    def _schedule_after_ahead(self, ahead: SchedulerOutput, launched: Launched) -> list[RequestOutput]:
        """Schedules the next step for real; keeps the launch made ahead if it is that step.

        NOTE: a discarded launch only wrote, for requests still running, the same K/V the
        real step writes again, and for finished ones into freed blocks that nothing reads
        before the real step, which runs after it on the same stream.
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._next_schedule_s = time.perf_counter() - t0
        outputs = self.output_processor.collect_aborted(plan.finished_request_ids)
        if not plan.is_empty:
            same = self.scheduler.is_ahead_plan(plan, ahead)
            self._inflight = (plan, launched if same else self.runner.launch(plan))
        return outputs

    # ---- requests out ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Stops every copy of a request; its blocks are free before this returns, and the next
        step reports each copy finished with "abort"."""
        self.scheduler.abort(self.output_processor.abort(request_id))

    # ---- convenience -------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Runs one request to the end, yielding its outputs (other queued requests run too)."""
        request_id = self.add_request(prompt, params)
        remaining = (params or SamplingParams()).n
        while remaining:
            for out in self.step():
                if out.request_id == request_id:
                    remaining -= out.finished
                    yield out

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[AdapterChoice | None] | None = None,
    ) -> list[GenerationResult]:
        """Runs all prompts together (continuous batching), each with its LoRA `adapters` (None: all
        plain), and returns them in order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        choices = list(adapters) if adapters is not None else [None] * len(prompts)
        ids = [self.add_request(p, sp, adapters=a) for p, sp, a in zip(prompts, params_list, choices)]
        results = {rid: GenerationResult(rid, self.output_processor.prompt_token_ids(rid), []) for rid in ids}
        merged: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                copy = merged.setdefault((out.request_id, out.index), RequestOutput(out.request_id, out.index))
                copy.merge(out)
                result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                if out.finished:
                    result.completions.append(copy)
        for result in results.values():
            result.completions.sort(key=lambda c: c.index)
        return [results[rid] for rid in ids]

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        spec = self.spec_stats()
        stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens = spec.num_draft_tokens, spec.num_accepted_tokens
        stats.spec_acceptance_rate = spec.acceptance_rate
        stats.spec_accepted_tokens_per_step = spec.accepted_tokens_per_step
        return stats

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters (all zero when it is off)."""
        return self.speculator.stats if self.speculator is not None else SpecStats()
