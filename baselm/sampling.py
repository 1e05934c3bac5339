"""Sampling: per-request `SamplingParams` and the batched `Sampler` that turns logits into token ids.

The sampler works on the logits of the last position of every scheduled request,
`(num_seqs, vocab)`, in this order:

1. logits processors (per row; grammar-constrained decoding plugs in here),
2. `logit_bias`,
3. the `min_tokens` mask (eos and stop ids cannot be drawn before `min_tokens` tokens exist),
4. penalties: repetition (HF: over prompt and output), then frequency and presence
   (OpenAI: over output only).

These are the *processed* logits. Logprobs are `log_softmax` of the processed logits,
taken before temperature and truncation: they describe the distribution the model (with
the request's own processors, bias and penalties) assigns, so they do not change with
temperature, top-k, top-p or min-p, as OpenAI reports them. Then:

5. temperature, top-k, top-p, min-p (sampled rows only),
6. a draw by the Gumbel-max trick, `argmax(logits / T + g)` with `g ~ Gumbel(0, 1)`, which
   is an exact draw from `softmax(logits / T)`; greedy rows take `argmax` of the
   processed logits.

Reproducibility: a request with a `seed` draws its noise from a key derived from
`(seed, number of tokens it has generated)`, so it gets the same tokens whatever else is
in the batch, at whatever step, and after preemption. Unseeded requests share the
sampler's own generator, split once per step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

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

# (generated token ids so far, logits (vocab,)) -> logits (vocab,)
LogitsProcessor = Callable[[list[int], mx.array], mx.array]

_U64 = (1 << 64) - 1


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
    top k alternatives (at most 20). `stop` may be given as one string. `n` > 1 asks for
    that many copies (see `for_copy`); `make_logits_processors`, when given, makes each
    copy's own `logits_processors` (stateful ones, like a grammar, must not be shared).
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
        the first gets fresh processors.
        """
        if index == 0:
            return self
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > MAX_SEED:
            seed -= 1 << 64
        processors = self.make_logits_processors() if self.make_logits_processors else self.logits_processors
        return replace(self, seed=seed, logits_processors=processors)

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def needs_host_ids(self, vocab_size: int) -> bool:
        """True when a draw needs the generated ids on the host (processors, penalties) or reads
        the device back (a top-k/top-p cut on a sampled row), so a step cannot be launched on the
        previous step's sampled ids before they are read (decode pipelining)."""
        if self.logits_processors or self.has_penalties:
            return True
        return not self.greedy and (0 < self.top_k < vocab_size or self.top_p < 1.0)

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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs is not supported; leave it unset.")
        for proc in self.logits_processors:
            if not callable(proc):
                raise SamplingParamsError("logits_processors", f"logits_processors holds {proc!r}, not a callable.")
        if self.make_logits_processors is not None and not callable(self.make_logits_processors):
            raise SamplingParamsError("make_logits_processors", "make_logits_processors must be a callable.")

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


def min_tokens_banned_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> list[int]:
    """Token ids a request may not draw while it has fewer than `min_tokens` output tokens."""
    if params.min_tokens == 0:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return sorted(banned)


class SamplingSequence(Protocol):
    """What the sampler reads of a request (a Request can be passed as is)."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class SamplingRow:
    """A plain SamplingSequence: one row of the batch the sampler sees."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class TokenLogprobs:
    """The chosen token's logprob and, best first, the top alternatives the request asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """Sampled ids and, when any row asked for them, logprobs (arrays stay lazy until read)."""

    token_ids: mx.array  # (num_seqs,) int32
    logprobs: mx.array | None  # (num_seqs,) float32: logprob of each sampled token
    top_token_ids: mx.array | None  # (num_seqs, max_k) int32, best first
    top_logprobs: mx.array | None  # (num_seqs, max_k) float32
    num_logprobs: list[int | None]  # per row: the request's `logprobs`

    def row_logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: None when the request asked for no logprobs, else its TokenLogprobs."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        ids = self.token_ids.tolist()
        chosen = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist() if self.top_token_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        rows: list[TokenLogprobs | None] = []
        for i, k in enumerate(self.num_logprobs):
            if k is None:
                rows.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k else []
            rows.append(TokenLogprobs(ids[i], chosen[i], top))
        return rows


class Sampler:
    """Turns a batch of logits into one token per row, honouring each row's SamplingParams.

    `eos_token_ids` are masked for rows still short of `min_tokens`. `seed` fixes the
    generator unseeded requests share (random when None).
    """

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed & _U64)

    def __call__(self, logits: mx.array, seqs: Sequence[SamplingSequence]) -> SamplerOutput:
        """logits: (num_seqs, vocab); row i belongs to seqs[i]."""
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {logits.shape} do not match {len(seqs)} sequences.")
        params = [s.sampling_params for s in seqs]
        x = self.process(logits.astype(mx.float32), seqs)  # (num_seqs, vocab)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            scaled = self.truncate(x, params)
            token_ids = mx.argmax(scaled + self._noise(seqs, sampled, x.shape[1]), axis=-1)
        else:
            token_ids = mx.argmax(x, axis=-1)
        token_ids = token_ids.astype(mx.int32)  # (num_seqs,)
        return _with_logprobs(x, token_ids, [p.logprobs for p in params])

    def process(self, logits: mx.array, seqs: Sequence[SamplingSequence]) -> mx.array:
        """Steps 1-4: processors, logit_bias, min_tokens mask, penalties; (num_seqs, vocab) float32."""
        x = _apply_processors(logits, seqs)
        vocab = x.shape[1]
        flat = x.reshape(-1)  # (num_seqs * vocab,)
        flat = _apply_logit_bias(flat, seqs, vocab)
        flat = self._apply_min_tokens(flat, seqs, vocab)
        flat = _apply_penalties(flat, seqs, vocab)
        return flat.reshape(x.shape)

    def _apply_min_tokens(self, flat: mx.array, seqs: Sequence[SamplingSequence], vocab: int) -> mx.array:
        index: list[np.ndarray] = []
        for row, s in enumerate(seqs):
            p = s.sampling_params
            if len(s.output_token_ids) < p.min_tokens:
                banned = min_tokens_banned_ids(p, self.eos_token_ids)
                index.append(np.asarray(banned, dtype=np.int64) + row * vocab)
        if index:
            flat[mx.array(np.concatenate(index))] = -mx.inf
        return flat

    def _noise(self, seqs: Sequence[SamplingSequence], sampled: list[int], vocab: int) -> mx.array:
        """Gumbel noise (num_seqs, vocab): per-request keys for seeded rows, zero on greedy rows."""
        noise = mx.zeros((len(seqs), vocab), dtype=mx.float32)
        unseeded = [i for i in sampled if seqs[i].sampling_params.seed is None]
        if unseeded:
            self._key, key = mx.random.split(self._key)
            noise[mx.array(unseeded)] = mx.random.gumbel((len(unseeded), vocab), key=key)
        seeded = [i for i in sampled if seqs[i].sampling_params.seed is not None]
        if seeded:
            rows = []
            for i in seeded:
                key = mx.random.key(step_seed(seqs[i].sampling_params.seed, len(seqs[i].output_token_ids)))
                rows.append(mx.random.gumbel((vocab,), key=key))
            noise[mx.array(seeded)] = mx.stack(rows)
        return noise

    @staticmethod
    def truncate(x: mx.array, params: Sequence[SamplingParams]) -> mx.array:
        """Step 5 on processed logits (num_seqs, vocab): temperature, then top-k, top-p, min-p.

        Returns the logits the draw uses, dropped tokens at -inf; greedy rows pass unchanged.
        """
        x = _scale(x, params)
        vocab = x.shape[1]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        cut = [i for i in sampled if 0 < params[i].top_k < vocab or params[i].top_p < 1.0]
        if cut:
            idx = mx.array(cut)
            top_k = mx.array([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in cut])
            top_p = mx.array([params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in cut])
            x[idx] = _top_k_top_p(x[idx], top_k, top_p)
        is_sampled = set(sampled)
        min_p = [params[i].min_p if i in is_sampled else 0.0 for i in range(len(params))]
        if any(min_p):
            # p >= min_p * p_max  <=>  logit - max_logit >= log(min_p), on the tempered logits.
            log_min_p = mx.array([math.log(m) if m > 0 else -math.inf for m in min_p])[:, None]
            x = mx.where(x - mx.max(x, axis=-1, keepdims=True) >= log_min_p, x, -mx.inf)
        return x


def step_seed(seed: int, num_generated: int) -> int:
    """A 64-bit generator seed for one step of a seeded request (splitmix64 of both)."""
    z = ((seed & _U64) ^ ((num_generated + 1) * 0x9E3779B97F4A7C15)) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _apply_processors(x: mx.array, seqs: Sequence[SamplingSequence]) -> mx.array:
    for row, s in enumerate(seqs):
        procs = s.sampling_params.logits_processors
        if not procs:
            continue
        out_ids = list(s.output_token_ids)
        logits = x[row]
        for proc in procs:
            logits = proc(out_ids, logits)
            if logits.shape != (x.shape[1],):
                raise ValueError(f"logits processor {proc!r} returned shape {logits.shape}, not ({x.shape[1]},).")
        x[row] = logits.astype(mx.float32)
    return x


def _apply_logit_bias(flat: mx.array, seqs: Sequence[SamplingSequence], vocab: int) -> mx.array:
    index: list[int] = []
    bias: list[float] = []
    for row, s in enumerate(seqs):
        for token_id, b in (s.sampling_params.logit_bias or {}).items():
            index.append(row * vocab + token_id)
            bias.append(b)
    if not index:
        return flat
    return flat.at[mx.array(index)].add(mx.array(bias, dtype=mx.float32))


def _apply_penalties(flat: mx.array, seqs: Sequence[SamplingSequence], vocab: int) -> mx.array:
    """Repetition (divide positive, multiply negative; prompt+output), then frequency and presence."""
    rep_index, rep_value, out_index, out_value, seen_index, seen_value = [], [], [], [], [], []
    for row, s in enumerate(seqs):
        p = s.sampling_params
        offset = row * vocab
        out_ids = np.asarray(s.output_token_ids, dtype=np.int64)
        if p.repetition_penalty != 1.0:
            ids = np.unique(np.concatenate([np.asarray(s.prompt_token_ids, dtype=np.int64), out_ids]))
            rep_index.append(ids + offset)
            rep_value.append(np.full(len(ids), p.repetition_penalty, dtype=np.float32))
        if p.frequency_penalty != 0.0 and len(out_ids):
            # Scatter-add with repeats: a token drawn c times is lowered c times.
            out_index.append(out_ids + offset)
            out_value.append(np.full(len(out_ids), -p.frequency_penalty, dtype=np.float32))
        if p.presence_penalty != 0.0 and len(out_ids):
            ids = np.unique(out_ids)
            seen_index.append(ids + offset)
            seen_value.append(np.full(len(ids), -p.presence_penalty, dtype=np.float32))
    if rep_index:
        index = mx.array(np.concatenate(rep_index))
        penalty = mx.array(np.concatenate(rep_value))
        values = flat[index]
        flat[index] = mx.where(values > 0, values / penalty, values * penalty)
    for index, value in ((out_index, out_value), (seen_index, seen_value)):
        if index:
            flat = flat.at[mx.array(np.concatenate(index))].add(mx.array(np.concatenate(value)))
    return flat


def _scale(x: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    temps = mx.array([1.0 if p.greedy else p.temperature for p in params], dtype=mx.float32)
    return x / temps[:, None]


_NUM_CANDIDATES = 512  # best tokens sorted per row; the nucleus almost always lies inside them


def _top_k_top_p(x: mx.array, top_k: mx.array, top_p: mx.array) -> mx.array:
    """x: (rows, vocab); keeps each row's top_k best, then the smallest head whose mass reaches top_p.

    Exact, without sorting the whole vocabulary: only the best `_NUM_CANDIDATES` tokens of a
    row are sorted (argpartition finds them), and probabilities use the full normalizer. A row
    whose kept head is not complete inside the candidates (a flat distribution, or top_k
    larger than the candidates but not off) is redone with a full sort.
    """
    rows, vocab = x.shape
    num = min(_NUM_CANDIDATES, vocab)
    if num == vocab:
        return _top_k_top_p_sorted(x, mx.argsort(-x, axis=-1), top_k, top_p)
    best = mx.argpartition(-x, num - 1, axis=-1)[:, :num]  # (rows, num): the best, unordered
    order = mx.take_along_axis(best, mx.argsort(-mx.take_along_axis(x, best, axis=-1), axis=-1), axis=-1)
    ranked = mx.take_along_axis(x, order, axis=-1)  # (rows, num) best first
    # Off (0 or -1) means the whole vocabulary; the mass is then normalized over all of it.
    k = mx.where(top_k > 0, mx.minimum(top_k, vocab), vocab)
    log_total = mx.where(
        k <= num,
        mx.logsumexp(mx.where(mx.arange(num) < k[:, None], ranked, -mx.inf), axis=-1),
        mx.logsumexp(x, axis=-1),
    )  # (rows,)
    probs = mx.exp(ranked - log_total[:, None])
    head_mass = probs.sum(axis=-1)
    complete = (k <= num) | ((k == vocab) & (head_mass >= top_p))  # the kept set lies in the candidates
    if not all(complete.tolist()):
        return _top_k_top_p_sorted(x, mx.argsort(-x, axis=-1), top_k, top_p)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    # NOTE: the best token always stays (mass_before = 0 < top_p).
    keep = (mx.arange(num)[None, :] < k[:, None]) & (mass_before < top_p[:, None])
    out = mx.full(x.shape, -mx.inf, dtype=x.dtype)
    return mx.put_along_axis(out, order, mx.where(keep, ranked, -mx.inf), axis=-1)


def _top_k_top_p_sorted(x: mx.array, order: mx.array, top_k: mx.array, top_p: mx.array) -> mx.array:
    """The same cut over a full sort of each row (`order`: (rows, vocab) indices, best first)."""
    ranked = mx.take_along_axis(x, order, axis=-1)
    k = mx.where(top_k > 0, top_k, x.shape[1])
    keep = mx.arange(x.shape[1])[None, :] < k[:, None]  # (rows, vocab) in rank order
    probs = mx.softmax(mx.where(keep, ranked, -mx.inf), axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    keep = keep & (mass_before < top_p[:, None])
    keep = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, keep, axis=-1)
    return mx.where(keep, x, -mx.inf)


def _with_logprobs(x: mx.array, token_ids: mx.array, num_logprobs: list[int | None]) -> SamplerOutput:
    if all(k is None for k in num_logprobs):
        return SamplerOutput(token_ids, None, None, None, num_logprobs)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)  # (num_seqs, vocab)
    chosen = mx.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    max_k = min(max(k or 0 for k in num_logprobs), x.shape[1])
    if max_k == 0:
        return SamplerOutput(token_ids, chosen, None, None, num_logprobs)
    head = mx.argpartition(-logprobs, kth=max_k - 1, axis=-1)[:, :max_k]  # (num_seqs, max_k), unordered
    head_lp = mx.take_along_axis(logprobs, head, axis=-1)
    order = mx.argsort(-head_lp, axis=-1)
    top_ids = mx.take_along_axis(head, order, axis=-1).astype(mx.int32)
    top_lp = mx.take_along_axis(head_lp, order, axis=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_lp, num_logprobs)
