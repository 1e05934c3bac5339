"""The engine's speculative decoding: before each step, proposals for the requests that decode;
after it, what was accepted, for the adaptive rule and the counters.

`Speculator.propose` runs before `Scheduler.schedule`: it picks the running requests that
decode one token this step and may speculate, asks the rule (`baselm.speculative.policy`) how many
drafts each is worth and the proposer for them, and leaves them on each request
(`draft_token_ids`, `draft_probs`), where the scheduler takes as many as the budget leaves.
The runner verifies them in the step's one forward and the sampler decides acceptance.
`observe` then records the step's cost and each request's acceptance.

Who does not speculate: requests with `speculative=False`, and requests with a logits processor
that cannot check drafts (`num_allowed`, see sampling.py). A grammar's processor can: proposals
are cut at the first token it refuses, its mask is applied at each verified row, and it goes
back to the tokens kept. Requests that ask for logprobs speculate; each emitted token's
logprobs come from the row that emitted it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from baselm.config import SpeculativeConfig
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.models.base import DecoderModel
from baselm.request import Request, RequestStatus
from baselm.runner import RunnerOutput
from baselm.scheduler import Scheduler, SchedulerOutput
from baselm.speculative.draft import DraftModelProposer
from baselm.speculative.ngram import NgramIndex
from baselm.speculative.policy import SHARED_DECAY, SHARED_IDLE_DECAY, Acceptance, StepCost, plan_drafts, plan_uniform

CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
CALIBRATION_PASSES = 3


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding's counters since start."""

    num_steps: int = 0  # steps that verified drafts
    num_verifications: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accepted_tokens_per_step(self) -> float:
        """Tokens a verifying request emits per step on average: its accepted drafts and one more."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications

    def to_json(self) -> dict[str, float]:
        return {
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_tokens_per_step": round(self.accepted_tokens_per_step, 3),
        }


def decodes(request: Request) -> bool:
    """Whether the request feeds only its newest token this step (its prompt is computed)."""
    return request.num_computed_tokens == request.num_tokens - 1


def can_speculate(request: Request) -> bool:
    """A running request that decodes one token this step, has room for more, and allows it."""
    params = request.sampling_params
    return (
        request.status == RequestStatus.RUNNING
        and decodes(request)
        and request.max_tokens - request.num_output_tokens > 1
        and getattr(params, "speculative", True)
        and all(hasattr(proc, "num_allowed") for proc in params.logits_processors)
    )


def num_allowed(request: Request, draft_ids: list[int]) -> int:
    """How many of `draft_ids` the request's logits processors allow in a row after its output."""
    allowed = len(draft_ids)
    for proc in request.sampling_params.logits_processors:
        if allowed:
            allowed = min(allowed, proc.num_allowed(list(request.output_token_ids), draft_ids[:allowed]))
    return allowed


class Speculator:
    """Proposals before a step, bookkeeping after it; one per engine."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None, max_num_batched_tokens: int):
        self.config = config
        self.draft = draft
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = StepCost()  # seconds of a target step by tokens fed
        self.stats = SpecStats()
        self._acceptance: dict[str, Acceptance] = {}
        self._ngram_indexes: dict[str, NgramIndex] = {}  # n-gram proposer state by request
        self._drafted: list[Request] = []  # requests given drafts for this step
        self._step = 0  # steps observed
        self._by_length: dict[int, Acceptance] = {}  # all n-gram verifications, by the length that matched
        self._matched: dict[str, int] = {}  # request id -> the length its proposal this step matched

    def calibrate(self, model: DecoderModel, cache: PagedKVCache, kv: KVCacheManager, max_tokens: int) -> None:
        """Measures the target's step time (and the draft model's) at a range of sizes now, so the
        first steps decide on measurements; real steps refine them (`observe`)."""
        _calibrate(self.cost, model, cache, kv, max_tokens)
        if self.draft is not None:
            _calibrate(self.draft.cost, self.draft.model, self.draft.cache, self.draft.kv, max_tokens)

    def propose(self, scheduler: Scheduler) -> None:
        """Leaves drafts on the running requests that are worth speculating this step.

        NOTE: this and `observe` run every step, between forwards, so they do little when nothing
        is proposed (free text): the n-gram lookup comes first and is two map operations, the
        rest runs only for requests it found something for, and requests that verified nothing
        are not visited after the step (`Acceptance.idle` catches them up when next asked)."""
        if self._drafted:
            self._clear_drafts()
        if self.draft is None:
            self._propose_ngram(scheduler)
            return
        adaptive = self.config.adaptive
        candidates = [r for r in scheduler.running if can_speculate(r)]
        acceptances = [self._acceptance_of(r) for r in candidates]
        if adaptive:
            candidates = [r for r, a in zip(candidates, acceptances) if not a.is_waiting]
            acceptances = [a for a in acceptances if not a.is_waiting]
        if candidates:
            num_others = sum(map(decodes, scheduler.running)) - len(candidates)
            max_drafts = self._max_drafts(candidates, acceptances)
            rates = [a.rate for a in acceptances]
            base_tokens = _base_tokens(scheduler, self.max_num_batched_tokens)
            self._propose_draft(candidates, rates, max_drafts, base_tokens, num_others)
            self._drafted = candidates

    def _propose_ngram(self, scheduler: Scheduler) -> None:
        k, adaptive = self.config.num_speculative_tokens, self.config.adaptive
        found, num_decoding = [], 0
        for request in scheduler.running:
            if decodes(request):
                num_decoding += 1
                proposal = self._ngram(request, min(k, request.max_tokens - request.num_output_tokens - 1))
                if proposal and can_speculate(request):
                    acceptance = self._acceptance_of(request)
                    if not (adaptive and acceptance.is_waiting):
                        found.append((request, proposal, acceptance))
        if not found:
            return  # NOTE: nothing proposed: the step is the plain one
        candidates = [r for r, _, _ in found]
        acceptances = [a for _, _, a in found]
        max_drafts = self._max_drafts(candidates, acceptances)
        proposals = [self._allowed(r, p[:m]) for (r, p, _), m in zip(found, max_drafts)]
        lengths = [len(p) for p in proposals]
        matched = [self._ngram_indexes[r.request_id].match_length for r in candidates]
        if adaptive:
            rates = [a.rate_with(self._by_match_length(n).rate) for a, n in zip(acceptances, matched)]
            base_tokens = _base_tokens(scheduler, self.max_num_batched_tokens)
            counts = plan_drafts(rates, lengths, base_tokens, self.cost, num_decoding - len(candidates))
        else:
            counts = lengths
        for request, proposal, count in zip(candidates, proposals, counts):
            request.draft_token_ids = proposal[:count]
        self._matched = dict(zip((r.request_id for r in candidates), matched))
        self._drafted = candidates

    def _max_drafts(self, candidates: list[Request], acceptances: list[Acceptance]) -> list[int]:
        """Per candidate: k, capped by its room left and, when adaptive, by its probing."""
        k = self.config.num_speculative_tokens
        max_drafts = [min(k, r.max_tokens - r.num_output_tokens - 1) for r in candidates]
        if self.config.adaptive:
            max_drafts = [a.max_drafts(m) for a, m in zip(acceptances, max_drafts)]
        return max_drafts

    def _clear_drafts(self) -> None:
        for request in self._drafted:
            request.draft_token_ids, request.draft_probs = [], None
        self._drafted = []

    def _propose_draft(
        self, candidates: list[Request], rates: list[float], max_drafts: list[int], base_tokens: int, num_others: int
    ) -> None:
        if self.config.adaptive:
            counts = plan_uniform(rates, max_drafts, base_tokens, self.cost, self.draft.draft_seconds, num_others)
        else:
            counts = max_drafts
        self.draft.propose(candidates, counts)
        for request in candidates:
            if request.draft_token_ids and request.sampling_params.logits_processors:
                keep = num_allowed(request, request.draft_token_ids)
                request.draft_token_ids = request.draft_token_ids[:keep]
                if request.draft_probs is not None:
                    request.draft_probs = request.draft_probs[:keep]

    def observe(self, plan: SchedulerOutput, result: RunnerOutput, seconds: float, scheduler: Scheduler) -> None:
        """After a step: its cost, each verifying request's acceptance, the counters.

        Only decode steps (every token fed is a sampling row, as in `calibrate`) measure the
        step cost: a prompt chunk of the same size computes one row of logits, not all."""
        if all(s.is_sampling and s.num_scheduled_tokens == s.num_draft_tokens + 1 for s in plan.requests):
            self.cost.observe(plan.num_scheduled_tokens, seconds)
        if self._drafted:
            self._observe_verified(plan, result)
            self._clear_drafts()
            self._matched = {}
        self._step += 1
        most = 2 * len(scheduler.requests) + 16
        if len(self._acceptance) > most or len(self._ngram_indexes) > most:  # forget finished requests now and then
            self._acceptance = {rid: a for rid, a in self._acceptance.items() if rid in scheduler.requests}
            self._ngram_indexes = {rid: i for rid, i in self._ngram_indexes.items() if rid in scheduler.requests}
        if self.draft is not None:
            self.draft.after_step(scheduler.requests)

    def _observe_verified(self, plan: SchedulerOutput, result: RunnerOutput) -> None:
        verified = False
        for scheduled in plan.requests:
            num_drafts = scheduled.num_draft_tokens
            if not num_drafts:
                continue  # caught up as idle when next asked (`_acceptance_of`)
            num_accepted = result.num_accepted.get(scheduled.request_id, 0)
            self._verified(self._acceptance_of(scheduled.request), num_drafts, num_accepted)
            if scheduled.request_id in self._matched:
                self._verified(self._by_match_length(self._matched[scheduled.request_id]), num_drafts, num_accepted)
            verified = True
            self.stats.num_verifications += 1
            self.stats.num_draft_tokens += num_drafts
            self.stats.num_accepted_tokens += num_accepted
        self.stats.num_steps += verified

    def _verified(self, acceptance: Acceptance, num_drafts: int, num_accepted: int) -> None:
        """A verification in this step: it counts, and the step is not an idle one for `acceptance`."""
        acceptance.observe(num_drafts, num_accepted)
        acceptance.step = self._step + 1

    def _ngram(self, request: Request, max_drafts: int) -> list[int]:
        index = self._ngram_indexes.get(request.request_id)
        if index is None:
            index = self._ngram_indexes[request.request_id] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return index.propose(request.all_token_ids, max_drafts)

    @staticmethod
    def _allowed(request: Request, proposal: list[int]) -> list[int]:
        """The proposal up to the first token the request's logits processors (a grammar) refuse."""
        if proposal and request.sampling_params.logits_processors:
            return proposal[: num_allowed(request, proposal)]
        return proposal

    def _by_match_length(self, n: int) -> Acceptance:
        """What verifications of proposals that followed an n-token suffix accepted, in all requests."""
        acceptance = self._by_length.get(n)
        if acceptance is None:
            acceptance = self._by_length[n] = Acceptance(SHARED_DECAY, SHARED_IDLE_DECAY)
            acceptance.step = self._step
        return self._caught_up(acceptance)

    def _acceptance_of(self, request: Request) -> Acceptance:
        """The request's acceptance as of this step: steps since it last verified count as idle."""
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is None:
            acceptance = self._acceptance[request.request_id] = Acceptance()
            acceptance.step = self._step
        return self._caught_up(acceptance)

    def _caught_up(self, acceptance: Acceptance) -> Acceptance:
        """NOTE: steps since it last verified count as idle: its evidence fades towards the prior."""
        if acceptance.step < self._step:
            acceptance.idle(self._step - acceptance.step)
            acceptance.step = self._step
        return acceptance


def _base_tokens(scheduler: Scheduler, budget: int) -> int:
    """The tokens the step feeds without drafts (each decoding request's one, prompt chunks)."""
    return min(sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running), budget)


def _calibrate(cost: StepCost, model: DecoderModel, cache: PagedKVCache, kv: KVCacheManager, max_tokens: int) -> None:
    """Passes over all sizes, each size once a pass (the curve keeps each size's fastest): on a
    shared machine a burst of load then slows one pass of every size, not every pass of a few."""
    measure_forward(model, cache, kv, 1, repeats=1)  # warm-up: first-call allocations
    sizes = [size for size in CALIBRATION_SIZES if size <= max_tokens]
    for _ in range(CALIBRATION_PASSES):
        for size in sizes:
            seconds = measure_forward(model, cache, kv, size, repeats=1)
            if seconds is None:  # the pool is too small for this size and the larger ones
                sizes = sizes[: sizes.index(size)]
                break
            cost.observe(size, seconds, calibration=True)
    # The largest steps' buffers go back to the system: kept in MLX's buffer cache, they made every
    # later one-token step ~6% slower here (9.6 vs 10.2 ms on SmolLM2, the same graph).
    mx.clear_cache()


def measure_forward(
    model: DecoderModel, cache: PagedKVCache, kv: KVCacheManager, num_tokens: int, repeats: int = 2
) -> float | None:
    """The fastest of `repeats` forwards of `num_tokens` tokens with logits at every position, on
    blocks borrowed from the pool (None when the pool is too small)."""
    probe = Request("__step_cost__", [0] * num_tokens)
    if not kv.allocate_slots(probe, num_tokens):
        return None
    try:
        positions = list(range(num_tokens))
        meta = AttentionMetadata.build([kv.block_table(probe)], [num_tokens], [num_tokens], kv.block_size, positions)
        ids = mx.zeros((num_tokens,), dtype=mx.int32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(mx.argmax(model(ids, meta.positions, meta, cache), axis=-1))  # with a greedy draw per row
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        kv.free(probe)
