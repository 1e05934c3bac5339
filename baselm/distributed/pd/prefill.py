"""The prefill side: prompts computed in a pool of its own, under its own prefix cache.

A `PrefillWorker` runs the engine's scheduler and runner over prompts only. Each request is
scheduled by the one scheduler rule (chunked prefill, prefix hits, in-flight prefix sharing,
preemption all work as in one process); the step that computes a prompt's last token samples
the first output token, and the request is then *parked*: out of the running list, so it is
never scheduled again here, but holding its blocks until they are shipped to a decode rank.
`release` then frees them; the full ones stay named in the prefix cache for later prompts.

With a prefix cache file (`--prefix-cache-file FILE`), each prefill rank R keeps its own cache in
`FILE.prefillR` (`rank_prefix_file`): loaded when the worker starts, saved when rank 0's plan
says so (its save interval, and as the group stops), as one process keeps FILE. Decode ranks
keep none: their cache holds blocks shipped to them, which a restarted group ships again from
the prefill ranks' files. Over machines, each prefill rank's file is on its own machine.

A request that asks for prompt logprobs is scored here, as its prompt is computed (chunk by
chunk, each position once), and its scores travel with the handoff. Processors do not travel:
a handoff carries the request's params without them (a decode rank makes its own from the
params' constraint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baselm.config import EngineConfig
from baselm.engine import make_cache, make_scheduler
from baselm.kv.manager import KVCacheManager
from baselm.kv.persist import PersistentPrefixCache
from baselm.loader import LoadedModel
from baselm.request import Request
from baselm.runner import ModelRunner
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.sampling.sampler import Sampler


@dataclass(slots=True)
class Handoff:
    """A prompt the prefill side finished: what a decode rank needs to continue it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int  # sampled from the prompt's last position
    logprobs: list[TokenLogprobs] | None  # [the first token's], when the request asks for logprobs
    num_cached_tokens: int  # prompt tokens the prefill side's prefix cache served
    num_blocks: int  # blocks holding the prompt's K/V: ceil(num prompt tokens / block_size)
    src: int = 0  # the prefill rank that holds them
    prompt_logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)  # (position, scored), when asked


def rank_prefix_file(path: str, rank: int) -> str:
    """The prefix cache file of prefill rank `rank` of a group started with `--prefix-cache-file path`."""
    return f"{path}.prefill{rank}"


class PrefillWorker:
    """Computes prompts and samples each one's first token; holds the finished ones' blocks until shipped."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, rank: int = 0):
        self.rank = rank
        self.vocab_size = loaded.model.args.vocab_size
        self.cache, self.max_model_len = make_cache(loaded, config)  # as LLMEngine's: every rank's is the same
        self.kv = KVCacheManager(self.cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = make_scheduler(self.kv, config, self.max_model_len)
        self.runner = ModelRunner(loaded.model, self.cache, Sampler(loaded.eos_token_ids, seed=config.seed))
        self.ready: dict[str, Handoff] = {}  # parked requests by id, in the order they finished
        self._prompt_scores: dict[str, list[tuple[int, TokenLogprobs]]] = {}  # prompt logprobs so far, by id
        self.prefix_file: PersistentPrefixCache | None = None
        if config.prefix_cache_file:
            path = rank_prefix_file(config.prefix_cache_file, rank)
            self.prefix_file = PersistentPrefixCache.open(
                path, loaded.path, self.kv, self.cache, config.prefix_cache_max_size
            )

    @property
    def is_busy(self) -> bool:
        """Prompts left to compute (parked ones do not count: they wait for a decode rank)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queues a prompt. NOTE: admitted for one output token (the scheduler's room check), then
        allowed two, so the scheduler takes the first sampled token with no stop decision: stop
        checks and max_tokens belong to the decode side, which sees the first token too."""
        request = Request(request_id, prompt_token_ids, params, max_tokens=1)
        self.scheduler.add_request(request)
        request.max_tokens = 2

    def step(self) -> None:
        """Runs one scheduled step over the prompts; parks those whose first token was sampled."""
        if not self.is_busy:
            return
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return
        result = self.runner.collect(self.runner.launch(plan))
        self._keep_prompt_scores(result.prompt_logprobs)
        self.scheduler.update(plan, result.sampled_token_ids)
        for scheduled in plan.requests:
            request = scheduled.request
            if request.request_id in result.sampled_token_ids:
                self.ready[request.request_id] = self._handoff(request, result.logprobs.get(request.request_id))
        if self.ready:
            self.scheduler.running = [r for r in self.scheduler.running if r.request_id not in self.ready]

    def _keep_prompt_scores(self, scored: dict[str, list[tuple[int, TokenLogprobs]]]) -> None:
        """Keeps each prompt position's logprobs once (a prompt recomputed after preemption scores them again)."""
        for request_id, entries in scored.items():
            kept = self._prompt_scores.setdefault(request_id, [])
            for position, entry in entries:
                if position == len(kept) + 1:
                    kept.append((position, entry))

    def _handoff(self, request: Request, logprobs: list[TokenLogprobs] | None) -> Handoff:
        return Handoff(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params.without_processors(),
            request.output_token_ids[0],
            logprobs,
            request.num_cached_tokens,
            len(self.kv.block_table(request)),
            self.rank,
            self._prompt_scores.pop(request.request_id, []),
        )

    def save_prefix_cache(self) -> int | None:
        """Writes this rank's prefix cache file if it has one and the cache changed; returns blocks written."""
        return self.prefix_file.save() if self.prefix_file is not None else None

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_table(self.scheduler.requests[request_id])

    def release(self, request_id: str) -> None:
        """Frees a parked request's blocks (shipped, or aborted); full ones stay in the prefix cache."""
        self.ready.pop(request_id)
        self.kv.free(self.scheduler.requests.pop(request_id))

    def abort(self, request_id: str) -> None:
        """Stops a prompt wherever it is here (queued, computing or parked) and frees its blocks."""
        self._prompt_scores.pop(request_id, None)
        if request_id in self.ready:
            self.release(request_id)
        else:
            self.scheduler.abort([request_id])
