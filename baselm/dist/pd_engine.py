"""Rank 0 of a prefill/decode group: the engine the server and AsyncEngine see.

`PDEngine` has LLMEngine's face (`add_request`, `step`, `abort`, `has_unfinished`, `stats`,
the tokenizer and limits), so `AsyncEngine` and the HTTP layer drive it unchanged. Behind it,
each `step` is one lockstep step of the group (pd_node.py): requests go to the prefill ranks
in the step's plan, and the outputs the decode ranks made come back in their reports.

Requests are checked here exactly as a single engine checks them (vocabulary, room, queue),
plus what a handoff cannot carry: n > 1 copies, prompt logprobs and custom logits
processors are refused with a clear error.

When a rank dies, the group cannot run another collective. The requests in flight fail with
RankFailedError (the API answers 503), and rank 0 goes on serving on its own: it builds a
single-process LLMEngine on the model it already holds (`fallback`), so the server keeps
answering what it still can.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext

from baselm.config import EngineConfig
from baselm.dist.group import RankFailedError
from baselm.dist.pd_node import Node, Plan, RankStats
from baselm.dist.watchdog import Watchdog
from baselm.engine import LLMEngine, QueueFullError
from baselm.loader import LoadedModel
from baselm.request import InvalidRequestError, RequestOutput
from baselm.sampling import SamplingParams
from baselm.scheduler import RequestTooLongError, SchedulerStats, effective_max_tokens

log = logging.getLogger("baselm.dist")


class PDEngine:
    """LLMEngine's interface over a prefill/decode group, on rank 0."""

    def __init__(
        self,
        node: Node,
        loaded: LoadedModel,
        config: EngineConfig,
        on_failure: Callable[[], None] | None = None,
        watchdog: Watchdog | None = None,
    ):
        """`on_failure`: called once when a rank failed (stops the ranks this process started).
        `watchdog`: armed around each step; a rank that stops answering without exiting would
        block the group's collectives forever, so its expiry should end the ranks (and with them
        the blocked collective, which then fails like any lost rank)."""
        self.node = node
        self.watchdog = watchdog
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = node.worker.max_model_len
        self.vocab_size = loaded.model.args.vocab_size
        self.prefix_file = None
        self.fallback: LLMEngine | None = None  # the single-process engine after a rank failed
        self.rank_stats: list[RankStats] = []  # every rank's, from the last step
        self._on_failure = on_failure
        self._ids = itertools.count()
        self._live: set[str] = set()  # requests not finished yet
        self._plan = Plan()
        self._aborted: list[RequestOutput] = []  # abort outputs for the next step
        self._where: dict[str, int] = {}  # request id -> its prefill rank, until a decode rank reports it

    # ---- the prefill side's model and pool, for embeddings between steps -------------

    @property
    def kv_manager(self):
        return self.fallback.kv_manager if self.fallback is not None else self.node.worker.kv

    @property
    def runner(self):
        return self.fallback.runner if self.fallback is not None else self.node.worker.runner

    @property
    def cache(self):
        return self.fallback.cache if self.fallback is not None else self.node.worker.cache

    # ---- requests in -------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        if self.fallback is not None:
            return self.fallback.add_request(prompt, params, request_id)
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        _check_handoff(params)
        if len(self._live) >= self.config.max_waiting + self.config.max_num_seqs * self.node.layout.num_decode:
            raise QueueFullError(f"{len(self._live)} requests are already in flight; try again shortly")
        request_id = request_id or self.new_request_id()
        if request_id in self._live:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError(f"request {request_id} has an empty prompt; give it at least one token")
        bad = next((i for i in prompt_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        self._check_fits(len(prompt_ids), params.max_tokens)
        rank = self._least_busy_prefill_rank()
        self._plan.add.append((rank, request_id, prompt_ids, params))
        self._live.add(request_id)
        self._where[request_id] = rank
        return request_id

    def _least_busy_prefill_rank(self) -> int:
        load = [0] * self.node.layout.num_prefill
        for rank in self._where.values():
            load[rank] += 1
        return min(range(len(load)), key=lambda r: (load[r], r))

    def _check_fits(self, num_prompt: int, max_tokens: int | None) -> None:
        """The room rule of one engine (`effective_max_tokens`) and the pools' size (all ranks' are equal)."""
        total = num_prompt + effective_max_tokens(num_prompt, max_tokens, self.max_model_len)
        kv = self.node.worker.kv
        num_blocks = -(-(total - 1) // kv.block_size)
        if num_blocks > kv.num_blocks:
            raise RequestTooLongError(
                f"the request needs up to {num_blocks} KV blocks of {kv.block_size} tokens but the cache has "
                f"only {kv.num_blocks}; lower max_tokens or give the KV cache more memory"
            )

    # ---- one step ----------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        if self.fallback is not None:
            return self.fallback.has_unfinished
        return bool(self._live or self._plan.abort or self._aborted)

    def step(self) -> list[RequestOutput]:
        """One lockstep step of the group; returns the outputs the decode ranks reported."""
        if self.fallback is not None:
            return self.fallback.step()
        plan, self._plan = self._plan, Plan()
        outputs, self._aborted = self._aborted, []
        try:
            with self.watchdog.armed("a prefill/decode step") if self.watchdog is not None else nullcontext():
                reports = self.node.step(plan)
        except RankFailedError as exc:
            self._fail()
            cause = exc.__cause__ or exc
            raise RankFailedError(
                f"a process of the prefill/decode group failed ({cause}); retry: the server goes on in one process"
            ) from exc
        self.rank_stats = [report.stats for report in reports]
        for report in reports:
            for out in report.outputs:
                if out.request_id not in self._live:
                    continue  # aborted here already
                self._where.pop(out.request_id, None)  # on a decode rank now: no load on its prefill rank
                if out.finished:
                    self._live.discard(out.request_id)
                outputs.append(out)
        return outputs

    def sync(self) -> list[RankStats]:
        """Runs one step with nothing new, so `rank_stats` is current (tests, `base bench`)."""
        self.step()
        return self.rank_stats

    def _fail(self) -> None:
        """A rank died: forget the group, serve alone from now on."""
        log.error("a rank of the prefill/decode group failed; serving from this process alone")
        self._live.clear()
        self._where.clear()
        self.node = None
        if self._on_failure is not None:
            self._on_failure()
        self.fallback = LLMEngine(self.loaded, self.config)

    # ---- requests out ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Stops a request on every rank; this step reports it finished with "abort"."""
        if self.fallback is not None:
            self.fallback.abort(request_id)
            return
        if request_id not in self._live:
            return
        self._live.discard(request_id)
        self._where.pop(request_id, None)
        self._plan.add = [a for a in self._plan.add if a[1] != request_id]
        self._plan.abort.append(request_id)
        self._aborted.append(RequestOutput(request_id, finished=True, finish_reason="abort"))

    def stop(self) -> None:
        """Tells every other rank to exit its loop (the group's last collective)."""
        if self.fallback is None and self.node is not None:
            self.node.step(Plan(stop=True))

    def save_prefix_cache(self) -> int | None:
        return None

    def stats(self) -> SchedulerStats:
        if self.fallback is not None:
            return self.fallback.stats()
        ranks = self.rank_stats
        num_blocks = sum(s.num_blocks for s in ranks) or 1
        num_free = sum(s.num_free_blocks for s in ranks)
        stats = SchedulerStats(
            num_running=sum(s.num_running for s in ranks),
            num_waiting=sum(s.num_waiting + s.num_parked for s in ranks),
            num_used_blocks=num_blocks - num_free,
            num_free_blocks=num_free,
            kv_usage=1.0 - num_free / num_blocks,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in ranks if s.role == "prefill"),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in ranks if s.role == "prefill"),
            num_preemptions=sum(s.num_preemptions for s in ranks),
        )
        stats.spec_num_draft_tokens = sum(s.spec_num_draft_tokens for s in ranks)
        stats.spec_num_accepted_tokens = sum(s.spec_num_accepted_tokens for s in ranks)
        return stats


def _check_handoff(params: SamplingParams) -> None:
    """What a prefill rank cannot hand to a decode rank: refused with a clear error."""
    if params.n != 1:
        raise InvalidRequestError("n > 1 is not supported when serving with --pd; ask for one choice per request")
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs is not supported when serving with --pd")
    if params.logits_processors or params.make_logits_processors is not None:
        raise InvalidRequestError(
            "constrained output (grammars, JSON schemas, forced tool calls) is not supported when serving with --pd"
        )
