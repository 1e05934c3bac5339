"""The output processor: each request's answer as its user sees it, and when it stops.

Every request has an `OutputState`: the streaming detokenizer, the stop checker (stop ids,
eos, stop strings, max_tokens: sampling/stop.py), and the text and logprobs its next output
reports. Once per step the engine hands the processor the step's sampled ids (`process`): it
detokenizes them, decides which requests stopped and why, and cuts each run of ids after the
id it stopped on; the engine hands that decision to the scheduler's `update`, which appends
the ids and frees the stopped requests, and then `complete`s each output here.

NOTE: the stop decision is made here and nowhere else, because a stop string is found in text
and only this module turns ids into text; the scheduler only applies it. So a step's results
flow one way: runner -> output processor (stops) -> scheduler (blocks) -> outputs.

The runaway guard (`RunawayGuard`) is a stop decision too: an answer that has said the same few
tokens over and over for `runaway_guard` tokens (EngineConfig; 0: off) ends there with "length",
the reason a cut answer has, and a log line. Requests with `ignore_eos` asked for their length
and are never cut; the first `min_tokens` tokens never are.

n > 1: a request asks for `n` copies of an answer to one prompt (`copy_requests`). Copy 0
runs under the request's own id, copy i under "{id}#{i}" with `params.for_copy(i)` (its own
seed and processors), each with an output state of its own. Copies after the first wait until
copy 0's prompt is in the KV cache, then fork from it and share its prompt blocks
(`start_forks`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from baselm.request import AdapterChoice, Request, RequestOutput, RequestStatus
from baselm.runner import RunnerOutput
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.sampling.stop import FINISH_LENGTH, StopChecker
from baselm.scheduler import Scheduler, SchedulerOutput
from baselm.tokenizer.detokenizer import StreamingDetokenizer
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.prompt import PromptImage

log = logging.getLogger("baselm.engine")


@dataclass(slots=True)
class StopDecisions:
    """What `OutputProcessor.process` decided over one step's sampled ids, for the scheduler's `update`."""

    token_ids: dict[str, list[int]]  # each sampling request's new ids, cut after the one it stopped on
    finish_reasons: dict[str, str]  # "stop" or "length", by request id, for the requests that stopped


class RunawayGuard:
    """Sees an answer's tokens one by one and says when it has become one n-gram said over and over:
    its last `window` tokens each equal the token `period` before them, for a period of at most
    window / 4 tokens (so the n-gram came at least five times in a row).

    NOTE: for each period p it keeps how many of the latest tokens equal the one p before them, so
    a token costs window / 4 comparisons and no search over the answer.
    """

    __slots__ = ("window", "_recent", "_runs")

    def __init__(self, window: int) -> None:
        self.window = window
        max_period = max(1, window // 4)
        self._recent: deque[int] = deque(maxlen=max_period)  # the latest tokens, oldest first
        self._runs = [0] * max_period  # [p - 1]: how many of the latest tokens equal the one p before them

    def add(self, token_id: int) -> int | None:
        """Takes the next token; returns the shortest period the answer has repeated for `window` tokens, if any."""
        period = None
        for p in range(1, len(self._recent) + 1):
            if self._recent[-p] == token_id:
                self._runs[p - 1] += 1
                if period is None and self._runs[p - 1] >= self.window:
                    period = p
            else:
                self._runs[p - 1] = 0
        self._recent.append(token_id)
        return period


class OutputState:
    """One request's output state: detokenizer, stop checker, runaway guard, text and logprobs not yet reported."""

    __slots__ = (
        "request", "user_request_id", "index", "detokenizer", "stop", "guard", "text", "logprobs", "stop_reason",
        "repeating",
        "prompt_logprobs", "num_prompt_scored",
    )  # fmt: skip

    def __init__(
        self,
        request: Request,
        user_request_id: str,
        index: int,
        detokenizer: StreamingDetokenizer,
        stop: StopChecker,
        guard: RunawayGuard | None = None,
    ):
        self.request = request
        self.user_request_id = user_request_id  # the id the user gave (copy i > 0 runs as "{id}#{i}")
        self.index = index  # which copy of an n > 1 request
        self.detokenizer = detokenizer
        self.stop = stop
        self.guard = guard  # None: this request is never cut for repeating itself
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.stop_reason: int | str | None = None
        self.repeating = False  # the guard cut it
        self.prompt_logprobs: list[TokenLogprobs] = []  # scored prompt tokens not yet reported
        self.num_prompt_scored = 0  # prompt tokens scored so far (a recomputed prompt scores them again)

    def add_tokens(self, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Detokenizes new ids one by one and checks each for a stop; returns the ids up to and
        including the one the request stopped on, and "stop" or "length" if it did."""
        for i, token_id in enumerate(token_ids):
            update = self.stop.update(token_id, self.detokenizer.add(token_id))
            self.text += update.text
            reason = update.finish_reason
            if reason is None and self._runs_away(token_id):
                reason = FINISH_LENGTH
                self.text += self.stop.flush()
            if reason == FINISH_LENGTH:
                self.text += self.detokenizer.finish()
            self.stop_reason = update.stop_reason
            if reason is not None:
                return token_ids[: i + 1], reason
        return token_ids, None

    def _runs_away(self, token_id: int) -> bool:
        """True when the guard cuts the answer at this token (it logs why)."""
        period = self.guard.add(token_id) if self.guard is not None else None
        if period is None or self.stop.num_tokens <= self.request.sampling_params.min_tokens:
            return False
        log.warning(
            "request %s cut after %d tokens: the last %d repeat a %d-token sequence (finish_reason length; "
            "the runaway guard, --runaway-guard 0 turns it off)",
            self.user_request_id, self.stop.num_tokens, self.guard.window, period,
            extra={"repeating": self.user_request_id},  # for `quiet_runaway_log`
        )  # fmt: skip
        self.repeating = True
        return True


def copy_requests(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    images: Sequence[PromptImage] = (),
    adapters: AdapterChoice | None = None,
) -> list[Request]:
    """The scheduler requests of all n copies, with the LoRA `adapters` they run with; the first is
    admitted, the others fork from it (the copies share the prompt's images, and so the vision
    tower's output)."""
    requests = [Request(request_id, prompt_ids, params, images=images, adapters=adapters)]
    requests += [
        Request(f"{request_id}#{i}", prompt_ids, params.for_copy(i), images=images, adapters=adapters)
        for i in range(1, params.n)
    ]
    return requests


class OutputProcessor:
    """The engine's table of requests: each one's output state, the copies of each n > 1 request,
    and the copies waiting to fork. States are keyed by scheduler request id (a copy's own id)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], runaway_guard: int = 0):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.runaway_guard = runaway_guard  # tokens an n-gram may repeat before the answer is cut; 0: off
        self._states: dict[str, OutputState] = {}  # scheduler request id -> output state
        self._copy_ids: dict[str, list[str]] = {}  # user's request id -> scheduler ids of its copies
        self._pending_forks: dict[str, list[Request]] = {}  # copy 0's id -> copies waiting for its prompt
        self._aborted_forks: list[str] = []  # copies aborted before they forked, to report

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._copy_ids

    @property
    def has_pending_forks(self) -> bool:
        return bool(self._pending_forks)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        return list(self._states[request_id].request.prompt_token_ids)

    def add(self, requests: Sequence[Request]) -> None:
        """Tracks a request (its copies, from `copy_requests`) once the scheduler admitted the first.

        NOTE: the scheduler filled in the first's max_tokens; every copy gets the same.
        """
        first = requests[0]
        for index, request in enumerate(requests):
            request.max_tokens = first.max_tokens
            params = request.sampling_params
            stop = StopChecker(params, self.eos_token_ids, max_tokens=request.max_tokens)
            detokenizer = self.tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
            guard = RunawayGuard(self.runaway_guard) if self.runaway_guard and not params.ignore_eos else None
            self._states[request.request_id] = OutputState(request, first.request_id, index, detokenizer, stop, guard)
        self._copy_ids[first.request_id] = [r.request_id for r in requests]
        if len(requests) > 1:
            self._pending_forks[first.request_id] = list(requests[1:])

    def abort(self, request_id: str) -> list[str]:
        """Marks the copies still waiting to fork aborted (the next `collect_aborted` reports them);
        returns the scheduler ids of all copies, for the scheduler to abort."""
        for child in self._pending_forks.pop(request_id, []):
            child.status = RequestStatus.FINISHED_ABORTED
            self._aborted_forks.append(child.request_id)
        return list(self._copy_ids.get(request_id, []))

    def process(self, plan: SchedulerOutput, result: RunnerOutput) -> StopDecisions:
        """Takes a finished step's results, once per step, before the scheduler's `update`: detokenizes
        each request's new ids, decides which requests stopped and why (ids after a stop are cut, as
        a speculative run may go past one), and keeps their logprobs and the scored prompt tokens."""
        self._add_prompt_logprobs(result.prompt_logprobs)
        decisions = StopDecisions(dict(result.sampled_token_ids), {})
        for scheduled in plan.requests:
            request_id = scheduled.request_id
            token_ids = result.sampled_token_ids.get(request_id)
            if not token_ids or scheduled.request.is_finished:  # a prompt chunk, or aborted while it ran
                continue
            state = self._states[request_id]
            kept, reason = state.add_tokens(token_ids)
            decisions.token_ids[request_id] = kept
            if reason is not None:
                decisions.finish_reasons[request_id] = reason
            entries = result.logprobs.get(request_id)
            if entries:
                state.logprobs += entries[: len(kept)]
        return decisions

    def _add_prompt_logprobs(self, scored: dict[str, list[tuple[int, TokenLogprobs]]]) -> None:
        """Prompt tokens scored this step (position 1 is the second prompt token); each position is kept once."""
        for request_id, entries in scored.items():
            state = self._states.get(request_id)  # None: aborted since the step was launched
            for position, entry in entries if state is not None else ():
                if position == state.num_prompt_scored + 1:
                    state.prompt_logprobs.append(entry)
                    state.num_prompt_scored = position

    def complete(self, out: RequestOutput) -> RequestOutput:
        """Completes the scheduler's output of one request for the user: the request id the user gave,
        the copy's index, and the text and logprobs gathered since its last output."""
        request_id = out.request_id
        state = self._states[request_id]
        out.request_id, out.index = state.user_request_id, state.index
        out.text, out.logprobs, out.prompt_logprobs = state.text, state.logprobs, state.prompt_logprobs
        out.stop_reason = state.stop_reason if out.finished else None
        out.repeating = state.repeating and out.finished
        state.text, state.logprobs, state.prompt_logprobs = "", [], []
        if out.finished:
            self._forget(request_id)
        return out

    def collect_aborted(self, finished_request_ids: Iterable[str]) -> list[RequestOutput]:
        """Final outputs of the requests aborted since the last schedule (the scheduler's finished ids)."""
        outputs = []
        for request_id in [*finished_request_ids, *self._aborted_forks]:
            state = self._states.get(request_id)
            if state is not None and state.request.finish_reason == "abort":
                outputs.append(self.complete(RequestOutput.of(state.request, [])))
        self._aborted_forks = []
        return outputs

    def start_forks(self, scheduler: Scheduler) -> None:
        """Copies of an n > 1 request start once the first's prompt is in the cache, sharing its blocks."""
        for parent_id in list(self._pending_forks):
            parent = self._states.get(parent_id)
            if parent is not None and parent.request.num_output_tokens == 0 and not parent.request.is_finished:
                continue  # prompt not computed yet
            for child in self._pending_forks.pop(parent_id):
                if parent is not None and not parent.request.is_finished:
                    scheduler.fork_request(parent_id, child)
                else:  # the parent already finished: its freed blocks are still prefix-cache hits
                    scheduler.add_request(child)

    def _forget(self, request_id: str) -> None:
        state = self._states.pop(request_id)
        copy_ids = self._copy_ids.get(state.user_request_id)
        if copy_ids is not None and all(i not in self._states for i in copy_ids):
            del self._copy_ids[state.user_request_id]


@contextlib.contextmanager
def quiet_runaway_log(request_prefix: str = "") -> Iterator[None]:
    """While the block runs, the runaway guard's log line is left out for requests whose id starts
    with `request_prefix`: a command that streams the answer to a terminal (`base chat`, `base run`)
    says so after the answer instead, where the line would otherwise land inside the text."""

    def keep(record: logging.LogRecord) -> bool:
        request_id = getattr(record, "repeating", None)
        return request_id is None or not str(request_id).startswith(request_prefix)

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)
