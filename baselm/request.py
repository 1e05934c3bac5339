"""A generation request as the engine tracks it, its status, and what one step reports for it."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from baselm.sampling.params import TokenLogprobs

if TYPE_CHECKING:
    from baselm.vision.prompt import PromptImage


class InvalidRequestError(ValueError):
    """A request the engine cannot take as given (empty prompt, unknown token ids, ...)."""


@dataclass(frozen=True, slots=True)
class AdapterChoice:
    """The LoRA adapters one request runs with (baselm/served_adapters.py makes it): each adapter's
    slot in the served model and the request's scale of it, and `cache_key`, what names their K/V
    in block hashes (the adapters' contents and scales: equal keys compute equal K/V)."""

    slots: tuple[tuple[int, float], ...]  # (slot, scale) by slot; no scale is 0
    cache_key: str


class RequestStatus(enum.IntEnum):
    """Where a request is; every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: "stop", "length" or "abort"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISHED_STATUS_BY_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}


class Request:
    """Token ids in and out, and how far the KV cache has caught up with them.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache; each step
    the scheduler feeds a request tokens from there until it reaches `num_tokens`, which is
    when a new token is sampled.

    NOTE: 0 <= num_computed_tokens <= num_tokens; between steps an unfinished request has
    num_computed_tokens < num_tokens (its newest token is never computed yet).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "_all_token_ids", "sampling_params",
        "max_tokens", "arrival_time", "cache_salt", "status", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "block_hashes", "draft_token_ids", "draft_probs",
        "num_draft_tokens", "num_accepted_tokens", "images", "adapters", "rope_positions",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        images: Sequence[PromptImage] = (),
        adapters: AdapterChoice | None = None,
    ):
        """`max_tokens` defaults to `sampling_params.max_tokens`; None lets the scheduler fill it in.
        `images`: the prompt's images (baselm/vision/prompt.py), each over placeholder positions of the
        prompt; `adapters`: the LoRA adapters it runs with (None: the plain model)."""
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError(f"request {request_id} has an empty prompt; give it at least one token")
        if max_tokens is None:
            max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"request {request_id} asks for max_tokens={max_tokens}; it must be at least 1")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)  # prompt + output, appended in place
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt  # mixed into the first block's hash: no sharing across salts
        self.adapters = adapters  # mixed into the first block's hash too: their K/V are their own
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache when first scheduled
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hashes of the full blocks of all_token_ids, filled lazily
        # Speculative decoding: the tokens proposed to follow all_token_ids for the next step,
        # with the proposer's distributions (k, vocab) when it has them (None: point masses).
        self.draft_token_ids: list[int] = []
        self.draft_probs: Any = None
        self.num_draft_tokens = 0  # drafts verified so far
        self.num_accepted_tokens = 0  # of which accepted
        self.images = tuple(images)
        # An M-RoPE model's positions of the prompt and the delta after it (models/base.py:
        # rope_positions), computed once by the runner when the request is first scheduled.
        self.rope_positions: tuple[Any, int] | None = None
        for image in self.images:
            if image.num_tokens == 0 or image.end > len(self.prompt_token_ids):
                raise InvalidRequestError(f"request {request_id} has an image outside its prompt's positions")

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output ids; read-only by convention (use `append_output_token_ids`)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def computes_whole_prompt(self) -> bool:
        """True when every prompt position must go through the model (prompt logprobs): no prefix-cache hits."""
        return getattr(self.sampling_params, "prompt_logprobs", None) is not None

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (one copy of it, when n > 1): the one output type.

    The scheduler fills in the token fields under its own request id (`of`); the output
    processor (outputs.py) then completes it for the user: the request id the user gave, the
    copy's `index`, the new text, logprobs and stop reason. `generate` merges a copy's outputs into one.
    """

    request_id: str
    index: int = 0  # which copy of an n > 1 request
    text: str = ""  # new text, safe to show (held-back stop-string prefixes excluded)
    token_ids: list[int] = field(default_factory=list)  # new token ids
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. newly scored, in order
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    repeating: bool = False  # finished "length" by the runaway guard: it kept saying the same tokens
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits
    num_draft_tokens: int = 0  # speculative tokens verified so far
    num_accepted_tokens: int = 0  # of which accepted

    @classmethod
    def of(cls, request: Request, token_ids: list[int]) -> RequestOutput:
        """The token fields of `request`'s output, with `token_ids` new this step."""
        return cls(
            request_id=request.request_id,
            token_ids=token_ids,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def merge(self, later: RequestOutput) -> None:
        """Appends a later output of the same copy."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.prompt_logprobs += later.prompt_logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.repeating = later.repeating
        self.num_prompt_tokens, self.num_output_tokens = later.num_prompt_tokens, later.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.num_draft_tokens, self.num_accepted_tokens = later.num_draft_tokens, later.num_accepted_tokens
