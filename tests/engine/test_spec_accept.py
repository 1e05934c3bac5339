"""The acceptance rule: min(1, p/q) to accept, normalize(max(0, p - q)) at a rejection; the
greedy rule; and how a request's rows turn into its new tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from baselm.sampling.acceptance import emitted_tokens, point_masses, verify_sampled
from baselm.sampling.params import SamplingParams
from baselm.sampling.sampler import Sampler, SamplingRow

P = [0.5, 0.3, 0.2, 0.0]
Q = [0.25, 0.25, 0.25, 0.25]


def verify(p, q, draft_id, u, gumbel=(0.0, 0.0, 0.0, 0.0)):
    accepted, residual, has_residual = verify_sampled(
        mx.array([p]), mx.array([draft_id]), mx.array([q]), mx.array([u]), mx.array([gumbel])
    )
    return bool(accepted[0].item()), int(residual[0].item()), bool(has_residual[0].item())


def test_a_draft_is_accepted_with_probability_min_1_p_over_q():
    # p/q = 2, 1.2: always; 0.8: when u < 0.8; 0: never.
    assert verify(P, Q, 0, 0.999)[0] and verify(P, Q, 1, 0.999)[0]
    assert verify(P, Q, 2, 0.79)[0]
    assert not verify(P, Q, 2, 0.81)[0]
    assert not verify(P, Q, 3, 0.0)[0]


def test_the_residual_is_drawn_from_max_0_p_minus_q():
    # max(0, p - q) = [0.25, 0.05, 0, 0]: tokens 2 and 3 can never be drawn, whatever the noise.
    assert verify(P, Q, 2, 0.9, gumbel=(0.0, 0.0, 50.0, 50.0))[1] in (0, 1)
    # log 0.25 < log 0.05 + 2: the noise picks token 1.
    assert verify(P, Q, 2, 0.9, gumbel=(0.0, 2.0, 0.0, 0.0))[1] == 1
    # Over many draws the residual follows [5/6, 1/6]: with 20000 draws the share's standard
    # deviation is 0.0026, so 0.02 is more than 7 of them.
    rows = 20000
    gumbel = mx.random.gumbel((rows, 4), key=mx.random.key(0))
    _, residual, _ = verify_sampled(
        mx.broadcast_to(mx.array([P]), (rows, 4)),
        mx.full((rows,), 2),
        mx.broadcast_to(mx.array([Q]), (rows, 4)),
        mx.ones((rows,)),
        gumbel,
    )
    shares = np.bincount(np.array(residual), minlength=4) / rows
    np.testing.assert_allclose(shares, [5 / 6, 1 / 6, 0, 0], atol=0.02)


def test_a_point_mass_accepts_with_p_and_removes_the_draft_from_the_residual():
    q = np.array(point_masses(mx.array([1]), 4))[0].tolist()
    assert q == [0.0, 1.0, 0.0, 0.0]
    assert verify(P, q, 1, 0.29)[0] and not verify(P, q, 1, 0.31)[0]
    for noise in ((0.0, 9.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0), (0.0, 9.0, 3.0, 0.0)):
        assert verify(P, q, 1, 0.9, gumbel=noise)[1] != 1


def test_equal_p_and_q_leave_no_residual_and_always_accept():
    accepted, _, has_residual = verify(P, P, 2, 0.999)
    assert accepted and not has_residual


def test_rows_become_tokens_up_to_the_first_rejection():
    assert emitted_tokens([5, 6, 7], [True, True, True], [0, 0, 0], 9) == ([5, 6, 7, 9], 3)
    assert emitted_tokens([5, 6, 7], [True, False, True], [1, 2, 3], 9) == ([5, 2], 1)
    assert emitted_tokens([5, 6], [False, True], [4, 8], 9) == ([4], 0)
    assert emitted_tokens([], [], [], 9) == ([9], 0)


def test_greedy_rows_accept_the_argmax_and_emit_it():
    logits = mx.array([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0))] * 3
    out = Sampler(seed=0)(logits, rows, draft_ids=[1, 2, -1])
    assert out.token_ids.tolist() == [1, 0, 2]
    assert out.accepted.tolist() == [True, False, False]
    assert out.residual_ids.tolist() == [1, 0, 2]


def test_sampling_parameters_shape_p_before_acceptance():
    # A logit bias of -100 on the draft makes p(d) = 0: a draft the request can never draw is
    # rejected even when the model likes it best.
    logits = mx.array([[5.0, 0.0, 0.0, 0.0]])
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed, logit_bias={0: -100.0})
        out = Sampler(seed=0)(logits, [SamplingRow(params)], draft_ids=[0])
        assert out.accepted.tolist() == [False]
        assert out.residual_ids.item() != 0
