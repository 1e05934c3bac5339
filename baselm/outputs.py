"""Each request's copies (n > 1) and every copy's output state.

A request asks for `n` copies of an answer to one prompt. Copy 0 runs under the request's
own id, copy i under "{id}#{i}" with `params.for_copy(i)` (its own seed and processors).
Copies after the first wait until copy 0's prompt is in the KV cache, then fork from it and
share its prompt blocks (`start_forks`).

A copy's output state turns its appended token ids into text: the streaming detokenizer,
the stop checker (stop strings, stop ids, eos, max_tokens), and the text and logprobs that
the next output reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from baselm.request import Request, RequestOutput, RequestStatus
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.sampling.stop import StopChecker
from baselm.scheduler import Scheduler
from baselm.tokenizer.detokenizer import StreamingDetokenizer
from baselm.tokenizer.tokenizer import Tokenizer


class Copy:
    """One copy's output state: detokenizer, stop checker, text and logprobs not yet reported."""

    __slots__ = (
        "request", "group_id", "index", "detokenizer", "stop", "text", "logprobs", "stop_reason",
        "prompt_logprobs", "num_prompt_scored",
    )  # fmt: skip

    def __init__(
        self, request: Request, group_id: str, index: int, detokenizer: StreamingDetokenizer, stop: StopChecker
    ):
        self.request = request
        self.group_id = group_id  # the request id the user knows
        self.index = index
        self.detokenizer = detokenizer
        self.stop = stop
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # scored prompt tokens not yet reported
        self.num_prompt_scored = 0  # prompt tokens scored so far (a recomputed prompt scores them again)


def copy_requests(request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[Request]:
    """The scheduler requests of all n copies; the first is admitted, the others fork from it."""
    requests = [Request(request_id, prompt_ids, params)]
    requests += [Request(f"{request_id}#{i}", prompt_ids, params.for_copy(i)) for i in range(1, params.n)]
    return requests


class Copies:
    """The engine's table of requests: each request's copies, their output state, and the copies
    waiting to fork. Internal ids (a copy's scheduler request id) map to `Copy` objects."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._copies: dict[str, Copy] = {}  # internal id -> output state
        self._groups: dict[str, list[str]] = {}  # request id -> internal ids of its copies
        self._pending_forks: dict[str, list[Request]] = {}  # copy 0's id -> copies waiting for its prompt
        self._aborted_forks: list[str] = []  # copies aborted before they forked, to report

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def has_pending_forks(self) -> bool:
        return bool(self._pending_forks)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        return list(self._copies[request_id].request.prompt_token_ids)

    def add(self, requests: Sequence[Request]) -> None:
        """Tracks a request's copies (from `copy_requests`) once the scheduler admitted the first.

        NOTE: the scheduler filled in the first's max_tokens; every copy gets the same.
        """
        first = requests[0]
        for index, request in enumerate(requests):
            request.max_tokens = first.max_tokens
            params = request.sampling_params
            stop = StopChecker(params, self.eos_token_ids, max_tokens=request.max_tokens)
            detokenizer = self.tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
            self._copies[request.request_id] = Copy(request, first.request_id, index, detokenizer, stop)
        self._groups[first.request_id] = [r.request_id for r in requests]
        if len(requests) > 1:
            self._pending_forks[first.request_id] = list(requests[1:])

    def abort(self, request_id: str) -> list[str]:
        """Marks the copies still waiting to fork aborted (the next `collect_aborted` reports them);
        returns the internal ids of all copies, for the scheduler to abort."""
        for child in self._pending_forks.pop(request_id, []):
            child.status = RequestStatus.FINISHED_ABORTED
            self._aborted_forks.append(child.request_id)
        return list(self._groups.get(request_id, []))

    def check_stop(self, request: Request) -> str | None:
        """Scheduler callback after each appended token: detokenize, match stops, keep the text."""
        copy = self._copies[request.request_id]
        token_id = request.output_token_ids[-1]
        update = copy.stop.update(token_id, copy.detokenizer.add(token_id))
        copy.text += update.text
        if update.finish_reason == "length":
            copy.text += copy.detokenizer.finish()
        copy.stop_reason = update.stop_reason
        return update.finish_reason

    def add_logprobs(self, logprobs: dict[str, list[TokenLogprobs]], updates: list[RequestOutput]) -> None:
        """The logprobs of the ids each update appended (a speculative run may be cut by a stop)."""
        for out in updates:
            entries = logprobs.get(out.request_id)
            if entries:
                self._copies[out.request_id].logprobs += entries[: len(out.token_ids)]

    def add_prompt_logprobs(self, scored: dict[str, list[tuple[int, TokenLogprobs]]]) -> None:
        """Prompt tokens scored this step (position 1 is the second prompt token); each position is kept once."""
        for internal_id, entries in scored.items():
            copy = self._copies.get(internal_id)  # None: aborted since the step was launched
            for position, entry in entries if copy is not None else ():
                if position == copy.num_prompt_scored + 1:
                    copy.prompt_logprobs.append(entry)
                    copy.num_prompt_scored = position

    def complete(self, out: RequestOutput) -> RequestOutput:
        """Completes the scheduler's output of one copy for the user: the request id the user gave,
        the copy's index, and the text and logprobs gathered since its last output."""
        internal_id = out.request_id
        copy = self._copies[internal_id]
        out.request_id, out.index = copy.group_id, copy.index
        out.text, out.logprobs, out.prompt_logprobs = copy.text, copy.logprobs, copy.prompt_logprobs
        out.stop_reason = copy.stop_reason if out.finished else None
        copy.text, copy.logprobs, copy.prompt_logprobs = "", [], []
        if out.finished:
            self._forget(internal_id)
        return out

    def collect_aborted(self, finished_request_ids: Iterable[str]) -> list[RequestOutput]:
        """Final outputs of the copies aborted since the last schedule (the scheduler's finished ids)."""
        outputs = []
        for internal_id in [*finished_request_ids, *self._aborted_forks]:
            copy = self._copies.get(internal_id)
            if copy is not None and copy.request.finish_reason == "abort":
                outputs.append(self.complete(RequestOutput.of(copy.request, [])))
        self._aborted_forks = []
        return outputs

    def start_forks(self, scheduler: Scheduler) -> None:
        """Copies of an n > 1 request start once the first's prompt is in the cache, sharing its blocks."""
        for parent_id in list(self._pending_forks):
            parent = self._copies.get(parent_id)
            if parent is not None and parent.request.num_output_tokens == 0 and not parent.request.is_finished:
                continue  # prompt not computed yet
            for child in self._pending_forks.pop(parent_id):
                if parent is not None and not parent.request.is_finished:
                    scheduler.fork_request(parent_id, child)
                else:  # the parent already finished: its freed blocks are still prefix-cache hits
                    scheduler.add_request(child)

    def _forget(self, internal_id: str) -> None:
        copy = self._copies.pop(internal_id)
        group = self._groups.get(copy.group_id)
        if group is not None and all(i not in self._copies for i in group):
            del self._groups[copy.group_id]
