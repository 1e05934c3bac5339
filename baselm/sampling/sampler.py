"""The batched `Sampler`: the logits of a step's sampling requests in, one token id each out.

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

Speculative verification: a row may carry a draft token (and the distribution it was drawn
from); the sampler then also decides its acceptance and the residual token by the exact rule
of `baselm.sampling.acceptance`, from the same processed and truncated logits as the draw, with
noise of its own (keyed by the same position for seeded rows, salted apart from the draw's).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from baselm.sampling.acceptance import point_masses, verify_sampled
from baselm.sampling.params import TOP_K_CANDIDATES, SamplingParams, TokenLogprobs

_U64 = (1 << 64) - 1
# Salts that keep a seeded row's acceptance draws and residual draws apart from its token draw.
ACCEPT_SALT = 0xA5A5_0001
RESIDUAL_SALT = 0xA5A5_0002
DRAFT_SALT = 0xA5A5_0003


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
class SamplerOutput:
    """Sampled ids and, when any row asked for them, logprobs (arrays stay lazy until read)."""

    token_ids: mx.array  # (num_seqs,) int32
    logprobs: mx.array | None  # (num_seqs,) float32: logprob of each sampled token
    top_token_ids: mx.array | None  # (num_seqs, max_k) int32, best first
    top_logprobs: mx.array | None  # (num_seqs, max_k) float32
    num_logprobs: list[int | None]  # per row: the request's `logprobs`
    accepted: mx.array | None = None  # (num_seqs,) bool: the row's draft token is accepted
    residual_ids: mx.array | None = None  # (num_seqs,) int32: the token emitted if it is rejected
    emitted_ids: mx.array | None = None  # (num_seqs,) int32: verifying steps, the token each row's logprobs are of

    def row_logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: None when the request asked for no logprobs, else its TokenLogprobs (of the
        token the row emits: its draw, or on a verified row its draft or residual)."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        ids = (self.token_ids if self.emitted_ids is None else self.emitted_ids).tolist()
        chosen = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist() if self.top_token_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        rows: list[TokenLogprobs | None] = []
        for i, k in enumerate(self.num_logprobs):
            if k is None:
                rows.append(None)
                continue
            # Alternatives a grammar or logit bias forbids (-inf) cannot be drawn: they are left out.
            top = [(t, lp) for t, lp in zip(top_ids[i][:k], top_lps[i][:k]) if lp != -math.inf] if k else []
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

    def __call__(
        self,
        logits: mx.array,
        seqs: Sequence[SamplingSequence],
        draft_ids: Sequence[int] | None = None,
        draft_probs: Sequence[mx.array | None] | None = None,
    ) -> SamplerOutput:
        """logits: (num_seqs, vocab); row i belongs to seqs[i].

        `draft_ids`: per row the speculative token the row verifies, -1 for none; `draft_probs`:
        per row the distribution (vocab,) that token was drawn from, None for a point mass.
        """
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {logits.shape} do not match {len(seqs)} sequences.")
        params = [s.sampling_params for s in seqs]
        x = self.process(logits.astype(mx.float32), seqs)  # (num_seqs, vocab)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        scaled = x
        if sampled:
            scaled = self.truncate(x, params)
            token_ids = mx.argmax(scaled + self._noise(seqs, sampled, x.shape[1]), axis=-1)
        else:
            token_ids = mx.argmax(x, axis=-1)
        token_ids = token_ids.astype(mx.int32)  # (num_seqs,)
        num_logprobs = [p.logprobs for p in params]
        if draft_ids is None or all(d < 0 for d in draft_ids):
            return _with_logprobs(x, token_ids, num_logprobs)
        accepted, residual_ids = self._verify(scaled, token_ids, seqs, draft_ids, draft_probs)
        drafts = mx.array(list(draft_ids), dtype=mx.int32)  # (num_seqs,)
        # What each row emits if the run reaches it: its draft when accepted, else the residual;
        # rows without a draft their own draw. Logprobs are of those tokens.
        emitted_ids = mx.where(drafts >= 0, mx.where(accepted, drafts, residual_ids), token_ids)
        out = _with_logprobs(x, emitted_ids, num_logprobs)
        out.token_ids, out.accepted, out.residual_ids = token_ids, accepted, residual_ids
        out.emitted_ids = emitted_ids if out.logprobs is not None else None
        return out

    def _verify(
        self,
        scaled: mx.array,
        token_ids: mx.array,
        seqs: Sequence[SamplingSequence],
        draft_ids: Sequence[int],
        draft_probs: Sequence[mx.array | None] | None,
    ) -> tuple[mx.array, mx.array]:
        """Acceptance and residual per row: greedy rows accept a draft equal to their argmax and
        emit the argmax; sampled rows follow `verify_sampled`. Rows without a draft accept nothing."""
        drafts = mx.array(list(draft_ids), dtype=mx.int32)  # (num_seqs,)
        accepted = token_ids == drafts
        residual = token_ids
        rows = [i for i, d in enumerate(draft_ids) if d >= 0 and not seqs[i].sampling_params.greedy]
        if not rows:
            return accepted, residual
        vocab = scaled.shape[1]
        idx = mx.array(rows)
        probs = mx.softmax(scaled[idx], axis=-1)  # (rows, vocab): p after every sampling parameter
        q = point_masses(drafts[idx], vocab)
        given = [j for j, i in enumerate(rows) if draft_probs is not None and draft_probs[i] is not None]
        if given:
            q[mx.array(given)] = mx.stack([draft_probs[rows[j]] for j in given]).astype(mx.float32)
        uniforms = self.row_random(seqs, rows, ACCEPT_SALT, lambda shape, key: mx.random.uniform(shape=shape, key=key))
        gumbel = self.row_random(
            seqs, rows, RESIDUAL_SALT, lambda shape, key: mx.random.gumbel(shape + (vocab,), key=key)
        )
        ok, res, has_residual = verify_sampled(probs, drafts[idx], q, uniforms, gumbel)
        accepted[idx] = ok
        residual[idx] = mx.where(has_residual, res, token_ids[idx])
        return accepted, residual

    def row_random(self, seqs: Sequence[SamplingSequence], rows: list[int], salt: int, draw) -> mx.array:
        """Random values for `rows`, stacked in that order: `draw(shape, key)` with shape (n,) for the
        unseeded rows from the shared generator, and () per seeded row from a key of (seed ^ salt,
        tokens generated), so a seeded row's draws depend only on its own position."""
        values: list[mx.array | None] = [None] * len(rows)
        unseeded = [j for j, i in enumerate(rows) if seqs[i].sampling_params.seed is None]
        if unseeded:
            self._key, key = mx.random.split(self._key)
            drawn = draw((len(unseeded),), key)
            for n, j in enumerate(unseeded):
                values[j] = drawn[n]
        for j, i in enumerate(rows):
            if values[j] is None:
                seed = seqs[i].sampling_params.seed ^ salt
                values[j] = draw((), mx.random.key(step_seed(seed, len(seqs[i].output_token_ids))))
        return mx.stack(values)

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
            ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in cut]
            top_p = mx.array([params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in cut])
            x[idx] = _top_k_top_p(x[idx], mx.array(ks), top_p, max(ks) <= TOP_K_CANDIDATES)
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


def _top_k_top_p(x: mx.array, top_k: mx.array, top_p: mx.array, within: bool = False) -> mx.array:
    """x: (rows, vocab); keeps each row's top_k best, then the smallest head whose mass reaches top_p.

    Exact, without sorting the whole vocabulary: only the best `TOP_K_CANDIDATES` tokens of a
    row are sorted (argpartition finds them; the nucleus almost always lies inside them), and
    probabilities use the full normalizer. A row whose kept head is not complete inside the
    candidates (a flat distribution, or top_k larger than the candidates but not off) is redone
    with a full sort. `within`: every row's top_k is known to be at most the candidates, so every
    head is complete and nothing is read back from the device (see `SamplingParams.needs_host_ids`).
    """
    rows, vocab = x.shape
    num = min(TOP_K_CANDIDATES, vocab)
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
    if not within and not all(complete.tolist()):
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
