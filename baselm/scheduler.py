"""The scheduler: which requests run this step, with how many tokens each, and what follows.

One rule, no phases: each request has `num_computed_tokens` and `num_tokens`, and each step
gives it tokens from a shared budget until it catches up. A fresh prompt, a prefix hit, a
chunk of a long prompt, a decode and a request resumed after preemption are all the same
thing: the tokens in `all_token_ids[num_computed_tokens:]`. Running requests are served
first, in admission order, so a long prompt never stalls running streams; then waiting
requests, first come first served, while budget, sequence slots and KV blocks last.

Decode pipelining plans one step further: while a decoding batch runs, `schedule_ahead`
plans the step after it (one more token each, its KV block allocated) so the runner can
launch that step on the sampled ids still on the device; the real `schedule` then decides
whether that launch is the step to run (`is_ahead_plan`).

Speculative tokens follow the same rule: a decoding request with proposed tokens
(`request.draft_token_ids`, set before `schedule`) feeds its newest token and as many of
them as the budget leaves, so one forward verifies them all; `update` keeps the K/V of the
accepted ones and gives the rejected positions back by lowering `num_computed_tokens`.

The scheduler never decides that a request stopped: `update` is told which did and why (the
engine's output processor decides, outputs.py) and finishes them, freeing their blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from baselm.kv.inflight import InflightBlocks
from baselm.kv.manager import KVCacheManager
from baselm.request import FINISHED_STATUS_BY_REASON, Request, RequestOutput, RequestStatus
from baselm.vision.prompt import chunk_end


class RequestTooLongError(ValueError):
    """A request that could never be served with this model length or KV cache size.

    `field` names what is at fault: "prompt" (it leaves no room to generate) or "max_tokens".
    """

    def __init__(self, message: str, field: str = "max_tokens") -> None:
        super().__init__(message)
        self.field = field


def effective_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens a request gets: `max_tokens`, or all the room its prompt leaves when None.

    NOTE: the one rule for context room; raises RequestTooLongError when the prompt leaves no
    room to generate or prompt + max_tokens exceed `max_model_len`. Its message says "maximum
    context length is N tokens" as OpenAI's does: litellm and langchain recognize it by that text.
    """
    if num_prompt_tokens >= max_model_len:
        raise RequestTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {num_prompt_tokens}, "
            "leaving no room to generate; shorten the prompt",
            field="prompt",
        )
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the request needs {total} "
            f"({num_prompt_tokens} prompt + {max_tokens} max_tokens); shorten the prompt or lower max_tokens",
            field="max_tokens",
        )
    return max_tokens


@dataclass(slots=True, kw_only=True)
class ScheduledRequest:
    """One request's share of a step: what the runner feeds and where its K/V lives."""

    request: Request
    token_ids: list[int]  # the tokens to feed: all_token_ids[num_computed_tokens : context_len]
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: list[int]  # the request's block table (live list; valid until the next schedule)
    is_sampling: bool  # the last fed token is the request's newest: sample one token from it
    is_new: bool  # first step since admission: new, forked, or resumed after preemption
    num_draft_tokens: int = 0  # speculative tokens at the end of token_ids, verified this step

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache after this step's writes (AttentionMetadata's context_lens)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """A step's plan: scheduled requests in feed order, and what changed since the last one."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # finished or aborted since the last schedule

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class SchedulerStats:
    """The queues, the KV cache's fill and the prefix cache's hits, for /metrics and the REPL's /stats."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int  # cached free blocks included
    kv_usage: float  # fraction of KV blocks in use
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found
    num_preemptions: int  # since start
    # Speculative decoding since start (the engine fills these in; zero when it is off).
    spec_num_draft_tokens: int = 0  # drafts verified
    spec_num_accepted_tokens: int = 0  # of which accepted
    spec_acceptance_rate: float = 0.0
    spec_accepted_tokens_per_step: float = 0.0  # tokens a verifying request emits per step
    # Prefill/decode disaggregation (--pd) since start; None in one process.
    kv_bytes_shipped: int | None = None  # KV bytes the prefill ranks sent to decode ranks
    kv_blocks_shipped: int | None = None
    kv_blocks_skipped: int | None = None  # prompt blocks not sent: the decode rank held them already

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    """Plans each step (`schedule`) and applies its results (`update`); owns the request queues."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
    ):
        """`long_prefill_token_threshold` > 0 caps the tokens one request gets per step (its chunk size).

        NOTE: the sizes come as EngineConfig validated them; they are not checked again here.
        """
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last is the newest
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._forked_ids: set[str] = set()  # forked into running, not scheduled yet: their first step is new
        # A waiting request whose prefix another is computing waits for those blocks (off: both compute them).
        self.share_inflight_prefixes = True

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queues a new request, or raises RequestTooLongError if it could never fit.

        A request without max_tokens gets whatever the model length leaves after its prompt.
        """
        if request.request_id in self.requests:
            raise ValueError(f"a request with id {request.request_id!r} is already queued or running")
        self._check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Adds `child` (same prompt as the running `parent_id`, for n > 1) sharing the parent's cached blocks.

        The child joins the running requests when a sequence slot is free, holding the
        parent's full blocks, and recomputes only the last partial block; otherwise it
        waits at the front of the queue and picks those blocks up as prefix hits.
        """
        if child.request_id in self.requests:
            raise ValueError(f"a request with id {child.request_id!r} is already queued or running")
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"request {parent_id!r} is not running, so it cannot be forked")
        self._check_fits(child)
        self.requests[child.request_id] = child
        if len(self.running) < self.max_num_seqs:
            self.kv.fork(parent, child)
            child.num_cached_tokens = child.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._forked_ids.add(child.request_id)
        else:
            self.waiting.appendleft(child)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finishes the given requests now and frees their blocks; unknown or finished ids are ignored.

        If a step that includes them is in flight, `update` drops its results for them.
        """
        outputs = []
        aborted = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                aborted.add(request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(RequestOutput.of(request, []))
        if aborted:
            self.running = [r for r in self.running if r.request_id not in aborted]
        return outputs

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and tokens: running ones first, then waiting ones (FCFS)."""
        output = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        if not output.preempted_request_ids:  # under memory pressure, admit nobody new
            budget = self._schedule_waiting(output, budget)
        output.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return output

    def update(
        self,
        output: SchedulerOutput,
        new_token_ids: dict[str, list[int]],
        finish_reasons: Mapping[str, str] | None = None,
    ) -> list[RequestOutput]:
        """Applies a finished step: advances computed tokens, appends new ids, caches full blocks,
        finishes the requests that stopped.

        `new_token_ids` holds the new ids of every sampling request of `output`, cut after a stop;
        `finish_reasons` names the requests that stopped, with "stop" or "length". Returns one
        RequestOutput per request that got tokens.
        """
        finish_reasons = finish_reasons or {}
        outputs = []
        finished = False
        for scheduled in output.requests:
            request = scheduled.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduled.num_scheduled_tokens - scheduled.num_draft_tokens
            token_ids = _sampled_for(scheduled, new_token_ids)
            if token_ids:
                request.append_output_token_ids(token_ids)
                if scheduled.num_draft_tokens:
                    self._keep_accepted(request, scheduled, len(token_ids))
            # NOTE: num_computed_tokens <= num_tokens, and the request's blocks cover it.
            self.kv.cache_full_blocks(request)
            if not token_ids:
                continue
            status = _finish_status(request, finish_reasons.get(request.request_id))
            if status is not None:
                self._finish(request, status)
                finished = True
            outputs.append(RequestOutput.of(request, token_ids))
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _keep_accepted(self, request: Request, scheduled: ScheduledRequest, num_appended: int) -> None:
        """After a verification step: the appended ids are the accepted drafts and one more, so the
        fed drafts before the newest id hold valid K/V; the rest are rolled back and the blocks
        that only they used go back to the pool."""
        request.num_draft_tokens += scheduled.num_draft_tokens
        request.num_accepted_tokens += num_appended - 1
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.trim(request, request.num_tokens)

    def schedule_ahead(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """Plans the step after `plan` before `plan` has run, when it is predictable: every request
        decodes one token, none is about to reach max_tokens, and nobody waits. Allocates the
        blocks that step writes (the real `schedule` finds them allocated); None when unpredictable.

        NOTE: the planned requests feed placeholder ids: the tokens `plan` samples, which only
        the device has yet.
        """
        if self.waiting or not all(self._can_run_ahead(s) for s in plan.requests):
            return None
        ahead = []
        for scheduled in plan.requests:
            request = scheduled.request
            if not self.kv.allocate_slots(request, 2):  # this step's token and the next one's
                return None
            ahead.append(
                ScheduledRequest(
                    request=request,
                    token_ids=[0],
                    num_computed_tokens=request.num_computed_tokens + 1,
                    block_ids=list(self.kv.block_table(request)),
                    is_sampling=True,
                    is_new=False,
                )
            )
        return SchedulerOutput(requests=ahead, num_scheduled_tokens=len(ahead))

    def is_ahead_plan(self, plan: SchedulerOutput, ahead: SchedulerOutput) -> bool:
        """True when `plan` is the step `ahead` predicted: the same requests, contexts and blocks."""
        return _decode_shape(plan, self.kv.block_size) == _decode_shape(ahead, self.kv.block_size)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_used_blocks=self.kv.num_blocks - self.kv.num_free_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        """Gives each running request its tokens, preempting the newest ones when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new == 0:  # an image to compute whole, larger than what the budget has left
                i += 1
                continue
            num_drafts = self._num_drafts(request, num_new, budget)
            if num_drafts and not self.kv.allocate_slots(request, num_new + num_drafts):
                num_drafts = 0  # short of blocks: drop the drafts before preempting anybody
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    return budget
            # NOTE: victims come from the end, past index i, so no scheduled request is ever preempted.
            is_new = bool(self._forked_ids) and request.request_id in self._forked_ids
            if is_new:
                self._forked_ids.discard(request.request_id)
            output.requests.append(self._scheduled(request, num_new, is_new, num_drafts))
            budget -= num_new + num_drafts
            i += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        """Admits waiting requests in order until budget, sequence slots or blocks run out.

        A request whose next uncached block a running request is computing now waits for it, in
        its place at the head of the queue, while the requests behind it are admitted: it
        starts once that block is cached and computes only what nobody else does.
        """
        inflight = InflightBlocks(self.kv, self.running) if self.share_inflight_prefixes else None
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)  # NOTE: it holds no blocks
            if inflight is not None and inflight.awaits(request, len(computed_blocks)):
                deferred.append(self.waiting.popleft())
                continue
            num_new = self._num_new_tokens(request, num_hit, budget)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            if inflight is not None:
                inflight.add(request, num_hit)
            if request.status == RequestStatus.WAITING:  # not on resumption after preemption
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.requests.append(self._scheduled(request, num_new, is_new=True))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    @staticmethod
    def _can_run_ahead(scheduled: ScheduledRequest) -> bool:
        request = scheduled.request
        # NOTE: a request aborted while its step runs must not get blocks again.
        decoding = scheduled.num_scheduled_tokens == 1 and scheduled.is_sampling and not request.is_finished
        return decoding and request.num_output_tokens + 1 < request.max_tokens

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens the request gets this step; 0 when next is an image to compute whole that the budget cannot hold."""
        num_new = min(request.num_tokens - num_computed, budget)
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return chunk_end(request.images, num_computed, num_computed + num_new, budget) - num_computed

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's proposed tokens fit this step: only a request that samples
        this step verifies drafts, and they share the budget (and the chunk cap) with everything."""
        if not request.draft_token_ids or request.num_computed_tokens + num_new != request.num_tokens:
            return 0
        room = budget - num_new
        if self.long_prefill_token_threshold:
            room = min(room, self.long_prefill_token_threshold - num_new)
        return max(0, min(len(request.draft_token_ids), room))

    def _scheduled(self, request: Request, num_new: int, is_new: bool, num_drafts: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request=request,
            token_ids=request.all_token_ids[start:end] + request.draft_token_ids[:num_drafts],
            num_computed_tokens=start,
            block_ids=self.kv.block_table(request),
            is_sampling=end == request.num_tokens,
            is_new=is_new,
            num_draft_tokens=num_drafts,
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the K/V, start over later from the front of the queue."""
        self.kv.free(request)
        self._forked_ids.discard(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Marks a request finished and frees its blocks; the caller removes it from `running`."""
        request.status = status
        self.kv.free(request)
        self._forked_ids.discard(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _check_fits(self, request: Request) -> None:
        """Raises RequestTooLongError unless the request fits; fills in a missing max_tokens."""
        request.max_tokens = effective_max_tokens(request.num_prompt_tokens, request.max_tokens, self.max_model_len)
        total = request.num_prompt_tokens + request.max_tokens
        # The last sampled token is never fed back, so its K/V is never stored.
        num_blocks = -(-(total - 1) // self.kv.block_size)
        if num_blocks > self.kv.num_blocks:
            raise RequestTooLongError(
                f"the request needs up to {num_blocks} KV blocks of {self.kv.block_size} tokens but the cache has "
                f"only {self.kv.num_blocks}; lower max_tokens or give the KV cache more memory"
            )


def _decode_shape(plan: SchedulerOutput, block_size: int) -> tuple:
    """What a decode step's graph depends on: each request, its context, the blocks it uses;
    () when some request does not decode one token."""
    shape = []
    for s in plan.requests:
        if s.num_scheduled_tokens != 1 or not s.is_sampling:
            return ()
        shape.append((s.request_id, s.context_len, tuple(s.block_ids[: -(-s.context_len // block_size)])))
    return tuple(shape)


def _finish_status(request: Request, reason: str | None) -> RequestStatus | None:
    """The final status a step's finish reason gives a request; None while it runs on.

    NOTE: a request at its max_tokens must have stopped: its blocks were reserved for no more.
    """
    if reason is None:
        if request.num_output_tokens >= request.max_tokens:
            raise ValueError(
                f"request {request.request_id} reached its max_tokens ({request.max_tokens}) but was not stopped"
            )
        return None
    status = FINISHED_STATUS_BY_REASON.get(reason)
    if status is None or status == RequestStatus.FINISHED_ABORTED:
        raise ValueError(
            f"request {request.request_id} got finish reason {reason!r}; a step stops with 'stop' or 'length'"
        )
    return status


def _sampled_for(scheduled: ScheduledRequest, new_token_ids: dict[str, list[int]]) -> list[int]:
    """The step's new ids for one request; a sampling request must have some, a chunk none."""
    token_ids = new_token_ids.get(scheduled.request_id)
    if scheduled.is_sampling and not token_ids:
        raise ValueError(f"request {scheduled.request_id} sampled this step but no token ids came back for it")
    if not scheduled.is_sampling and token_ids:
        raise ValueError(f"request {scheduled.request_id} fed a prompt chunk this step and cannot take sampled ids")
    return token_ids or []
