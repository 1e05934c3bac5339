"""Sampling parameters: how one request picks its tokens and when it stops.

`SamplingParams` holds a request's choices and is the one place that knows their ranges
(OpenAI's, and this server's limits where OpenAI has none); `TokenLogprobs` is what a
request gets back when it asks for logprobs. The batched draw lives in sampler.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

# Temperatures below this are greedy: dividing float32 logits by less means nothing anyway.
GREEDY_EPS = 1e-5
# OpenAI's ranges, and this server's limits where OpenAI has none of its own; the API refuses
# a value outside them with the SamplingParamsError that names the field.
MAX_N = 16  # copies of one request
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_OPENAI_PENALTY = 2.0
MAX_STOPS = 16
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # any signed or unsigned 64-bit integer
# The best tokens the sampler sorts per row for a top-k/top-p cut (sampler.py): a cut that keeps at
# most this many tokens is decided on the device alone.
TOP_K_CANDIDATES = 512

# (generated token ids so far, logits (vocab,)) -> logits (vocab,). It may be called with ids
# that go back (a speculative step verifies drafts, then keeps fewer). One that keeps state (a
# grammar's) may also offer `num_allowed(output_ids, draft_ids) -> int`, how many of the drafts
# it allows in a row after `output_ids`; a request speculates only when all its processors do.
LogitsProcessor = Callable[[list[int], mx.array], mx.array]


@dataclass(slots=True)
class Constraint:
    """A grammar an answer follows, as plain data: what its logits processors are made from.

    Processors hold a matcher's state and cannot leave their process; a constraint can, so a
    process that receives one makes its own processors from it (`SamplingParams.with_processors`,
    given the API's maker, which compiles it for the model's tokenizer).
    """

    grammar: str  # llguidance grammar text
    eos_token_ids: list[int]  # the tokens that may end the answer once the grammar is complete
    tool_format: str | None = None  # forced tool calls: also end the answer when a call repeats
    tool_close: str = ""  # what closes the forced calls as a whole, in formats that close them (`]`)


# Makes one request copy's processors from its constraint, in the process that samples.
ConstraintFactory = Callable[[Constraint], list[LogitsProcessor]]


class SamplingParamsError(ValueError):
    """A sampling parameter holds a value we cannot sample with; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops; validated on construction.

    NOTE: `validate` is the one place that knows the ranges (OpenAI's: temperature in
    [0, 2], top_p in (0, 1], penalties in [-2, 2], ...); the API only reads types.

    `max_tokens=None` means up to the context length (the engine caps it). `top_k` of
    0 or -1 is off. `logprobs`: None = none, 0 = the chosen token's only, k = also the
    top k alternatives (at most 20); `prompt_logprobs` the same for each prompt token after
    the first (see prompt_logprobs.py). `stop` may be given as one string. `n` > 1 asks for
    that many copies (see `for_copy`); `make_logits_processors`, when given, makes each
    copy's own `logits_processors` (stateful ones, like a grammar, must not be shared).
    `constraint`, when given, is what those processors were made from (see `Constraint`).
    """

    n: int = 1
    max_tokens: int | None = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    make_logits_processors: Callable[[], list[LogitsProcessor]] | None = None
    constraint: Constraint | None = None
    speculative: bool = True  # False: never verify speculative tokens for this request

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.logits_processors and callable(self.make_logits_processors):
            self.logits_processors = self.make_logits_processors()
        self.logits_processors = list(self.logits_processors or [])
        self.validate()

    def for_copy(self, index: int) -> SamplingParams:
        """The params of copy `index` (0 to n - 1) of an n > 1 request.

        Copy i draws with `seed + i` (mod 2**64, which the sampler's keys use anyway), so each
        copy has its own stream, reproducibly; with `make_logits_processors`, every copy after
        the first gets fresh processors. Prompt logprobs come with the first copy only (the
        others share its prompt).
        """
        if index == 0:
            return self
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > MAX_SEED:
            seed -= 1 << 64
        processors = self.make_logits_processors() if self.make_logits_processors else self.logits_processors
        return replace(self, seed=seed, logits_processors=processors, prompt_logprobs=None)

    def without_processors(self) -> SamplingParams:
        """These params as another process can receive them: no processors (a receiver makes its
        own from `constraint` with `with_processors`)."""
        if not self.logits_processors and self.make_logits_processors is None:
            return self
        return replace(self, logits_processors=[], make_logits_processors=None)

    def with_processors(self, make: ConstraintFactory | None) -> SamplingParams:
        """These params with processors of their own made from `constraint` by `make`; themselves
        when there is no constraint."""
        constraint = self.constraint
        if constraint is None:
            return self
        if make is None:
            raise SamplingParamsError("constraint", "this process cannot make a constraint's processors.")
        return replace(self, logits_processors=[], make_logits_processors=lambda: make(constraint))

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def needs_host_ids(self, vocab_size: int) -> bool:
        """True when a draw needs the generated ids on the host (processors, penalties) or reads
        the device back (a top-p cut whose kept tokens may reach past the sampler's sorted
        candidates: top_k off or above TOP_K_CANDIDATES), so a step cannot be launched on the
        previous step's sampled ids before they are read (decode pipelining)."""
        if self.logits_processors or self.has_penalties:
            return True
        if self.greedy:
            return False
        top_k = self.top_k if 0 < self.top_k < vocab_size else vocab_size
        return top_k > min(TOP_K_CANDIDATES, vocab_size) and (top_k < vocab_size or self.top_p < 1.0)

    def validate(self) -> None:
        """Raises SamplingParamsError naming the first field that holds a bad value."""
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), low=-MAX_OPENAI_PENALTY, high=MAX_OPENAI_PENALTY)
        self._validate_logit_bias()
        if self.seed is not None:
            _check_int("seed", self.seed, low=MIN_SEED, high=MAX_SEED)
        self._validate_stops()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for proc in self.logits_processors:
            if not callable(proc):
                raise SamplingParamsError("logits_processors", f"logits_processors holds {proc!r}, not a callable.")
        if self.make_logits_processors is not None and not callable(self.make_logits_processors):
            raise SamplingParamsError("make_logits_processors", "make_logits_processors must be a callable.")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingParamsError("constraint", f"constraint must be a Constraint, got {self.constraint!r}.")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises SamplingParamsError when a token id in the params lies outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamsError(name, f"{name} names token {bad[0]}, outside the vocabulary of {vocab_size}.")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "logit_bias must map token ids to biases.")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, low=0, what="logit_bias token id")
            _check_float("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS, what="logit_bias value")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOPS:
            raise SamplingParamsError("stop", f"stop holds {len(self.stop)} strings; at most {MAX_STOPS} are allowed.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop must hold non-empty strings, got {s!r}.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, what="stop_token_ids entry")


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None, what: str = "") -> None:
    what = what or name
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SamplingParamsError(name, f"{what} must be an integer, got {value!r}.")
    if low is not None and value < low:
        raise SamplingParamsError(name, f"{what} must be at least {low}, got {value}.")
    if high is not None and value > high:
        raise SamplingParamsError(name, f"{what} must be at most {high}, got {value}.")


def _check_float(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    what: str = "",
) -> None:
    what = what or name
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplingParamsError(name, f"{what} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{what} must be finite, got {value}.")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        lo = "(" if low_open else "["
        hi = f"{high}]" if high is not None else "inf)"
        raise SamplingParamsError(name, f"{what} must lie in {lo}{low}, {hi}, got {value}.")


@dataclass(slots=True)
class TokenLogprobs:
    """The chosen token's logprob and, best first, the top alternatives the request asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
