"""The acceptance rule of speculative sampling, on the device, for rows that verify a draft token.

A verification row holds the target's distribution p (after every sampling parameter) at
one position, the draft token d proposed there and the proposer's distribution q it was
drawn from (a point mass for n-gram proposals and greedy drafts). The rule keeps the output
distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023):

- accept d with probability min(1, p(d) / q(d)): with u ~ U[0, 1), accept when u * q(d) < p(d);
- at the first rejection emit a token from normalize(max(0, p - q)), the residual; for a
  point mass q that is p with d removed and renormalized;
- if every draft is accepted, emit a bonus token from p at the next position (the ordinary draw).

Greedy rows need no randomness: accept while the target's argmax equals the draft, then emit
the argmax.
"""

from __future__ import annotations

import mlx.core as mx


def point_masses(token_ids: mx.array, vocab: int) -> mx.array:
    """One-hot distributions (rows, vocab) float32 for `token_ids` (rows,)."""
    return (mx.arange(vocab)[None, :] == token_ids[:, None]).astype(mx.float32)


def verify_sampled(
    probs: mx.array, draft_ids: mx.array, draft_probs: mx.array, uniforms: mx.array, gumbel: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The rule on sampled rows.

    probs, draft_probs: (rows, vocab) p and q; draft_ids: (rows,) int; uniforms: (rows,) in
    [0, 1); gumbel: (rows, vocab) Gumbel(0, 1) noise for the residual draw.
    Returns (accepted (rows,) bool, residual ids (rows,) int32, has_residual (rows,) bool);
    has_residual is False where max(0, p - q) has no mass (p == q: then d is always accepted).
    """
    p_d = mx.take_along_axis(probs, draft_ids[:, None], axis=-1)[:, 0]  # (rows,)
    q_d = mx.take_along_axis(draft_probs, draft_ids[:, None], axis=-1)[:, 0]  # (rows,)
    accepted = uniforms * q_d < p_d
    residual_mass = mx.maximum(probs - draft_probs, 0.0)  # (rows, vocab)
    has_residual = residual_mass.sum(axis=-1) > 0
    residual = mx.argmax(mx.log(residual_mass) + gumbel, axis=-1).astype(mx.int32)  # log(0) = -inf: never drawn
    return accepted, residual, has_residual


def emitted_tokens(
    draft_ids: list[int], accepted: list[bool], residual_ids: list[int], bonus_id: int
) -> tuple[list[int], int]:
    """One request's new tokens after verifying `draft_ids` (k), from its k + 1 rows' results:
    the accepted drafts up to the first rejection, then that row's residual (or the bonus
    draw when all were accepted). Returns (new ids, number of drafts accepted)."""
    out = []
    for draft_id, ok, residual_id in zip(draft_ids, accepted, residual_ids):
        if not ok:
            return [*out, residual_id], len(out)
        out.append(draft_id)
    return [*out, bonus_id], len(out)
