"""The n-gram proposer and the rule that sizes each request's drafts from measured costs."""

from __future__ import annotations

import numpy as np
import pytest

from baselm.speculative.ngram import NgramIndex, propose_ngram
from baselm.speculative.policy import MIN_GAIN, Acceptance, StepCost, expected_tokens, plan_drafts, plan_uniform


def test_ngram_proposes_what_followed_the_longest_earlier_suffix():
    # Suffix [1, 2] occurred at the start, followed by 3, 4, 1.
    assert propose_ngram([1, 2, 3, 4, 1, 2], 1, 3, 3) == [3, 4, 1]
    # The 3-gram [9, 2, 3] beats the 2-gram [2, 3] that occurs at the start too.
    assert propose_ngram([2, 3, 7, 9, 2, 3, 8, 9, 2, 3], 1, 3, 2) == [8, 9]
    assert propose_ngram([1, 2, 3], 1, 3, 2) == []  # nothing repeats
    assert propose_ngram([1, 2, 3, 1], 2, 3, 2) == []  # only a 1-gram repeats; min_n is 2
    assert propose_ngram([1, 2, 3, 1], 1, 3, 0) == []


def test_ngram_prefers_an_occurrence_with_k_tokens_after_it():
    # The latest [5] is followed by one token only; the earliest by a full run.
    assert propose_ngram([5, 5, 5, 5], 1, 2, 3) == [5, 5]
    # [4, 5] occurs twice before the suffix; the later one has 3 tokens after it.
    assert propose_ngram([4, 5, 6, 7, 8, 4, 5, 6, 4, 5], 1, 2, 3) == [6, 4, 5]
    assert propose_ngram([4, 5, 6, 7, 8, 4, 5, 6, 4, 5], 1, 2, 4) == [6, 7, 8, 4]


def linear_cost(a: float = 0.1, b: float = 0.01) -> StepCost:
    cost = StepCost()
    for size in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(size, a + b * size)
    return cost


def test_step_cost_is_a_line_that_slow_or_lucky_sizes_do_not_bend():
    cost = linear_cost()
    assert cost.line() == pytest.approx((0.1, 0.01))
    cost.observe(16, 5.0)  # a slow outlier (a busy machine) does not raise the fastest at 16
    cost.observe(32, 0.01)  # one lucky size among seven: the median slope barely moves
    a, b = cost.line()
    assert a == pytest.approx(0.1, abs=0.02) and b == pytest.approx(0.01, abs=0.002)
    assert cost.seconds(100) == pytest.approx(a + 100 * b)
    single = StepCost()
    single.observe(4, 0.2)
    assert single.line() == (0.2, 0.0)


def test_cheap_rows_are_speculated_and_costly_batches_switch_it_off():
    cost = linear_cost()  # each token adds a tenth of a one-token step
    assert plan_drafts([0.9], [4], 1, cost) == [4]
    assert plan_drafts([0.5], [4], 1, cost) == [2]  # the third would add 0.125 tokens for 0.01 s: too little
    # 32 streams: the step costs 0.42 s for 32 tokens, a draft 0.01 s; it pays only when
    # accepted with more than 0.32 / 0.42.
    assert plan_drafts([0.7] * 32, [4] * 32, 32, cost) == [0] * 32
    counts = plan_drafts([0.95] * 32, [4] * 32, 32, cost)
    assert 0 < sum(counts) < 4 * 32
    # Better requests get their drafts first.
    counts = plan_drafts([0.9, 0.3], [4, 4], 2, linear_cost(b=0.05))
    assert counts[0] > counts[1]


def test_nothing_is_planned_before_anything_is_measured():
    assert plan_drafts([0.9], [4], 1, StepCost()) == [0]


def test_a_draft_model_that_costs_as_much_as_the_target_is_not_worth_it():
    cost = linear_cost()
    same = plan_uniform([0.99], [4], 1, cost, lambda k, n: k * cost.seconds(n))
    assert same == [0]
    cheap = plan_uniform([0.8], [4], 1, cost, lambda k, n: k * 0.1 * cost.seconds(n))
    assert cheap[0] > 0


def test_acceptance_counts_only_tested_drafts_and_returns_to_the_prior():
    a = Acceptance()
    prior = a.rate
    a.observe(4, 0)  # rejected at the first: one draft tested
    assert a.verified == 1 and a.rate < prior
    for _ in range(2000):
        a.observe(0, 0)
    assert abs(a.rate - prior) < 1e-6
    assert expected_tokens(0.5, 2) == 1.75


def test_a_request_that_accepts_nothing_backs_off_geometrically():
    a = Acceptance()
    assert not a.is_waiting and a.max_drafts(8) == 8
    waits = []
    for _ in range(8):
        a.observe(3, 0)  # a probe: nothing accepted
        steps = 0
        while a.is_waiting:
            a.observe(0, 0)
            steps += 1
        waits.append(steps)
        assert a.max_drafts(8) == 1  # then one cheap draft
    assert waits == [2, 4, 8, 16, 32, 64, 64, 64]
    a.observe(1, 1)  # one accepted draft ends the back-off
    assert not a.is_waiting and a.max_drafts(8) == 8


def test_the_line_is_refitted_only_when_a_sizes_fastest_changes():
    cost = linear_cost()
    line = cost.line()
    cost.observe(8, 1.0)  # slower than the fastest at 8: same line object
    assert cost.line() is line
    cost.observe(8, 0.15)
    assert cost.line() is not line  # refitted (Theil-Sen: one faster size barely moves it)


def stepped_cost() -> StepCost:
    """Up to 4 rows in one pass over the weights (5 ms each), a jump of 50 ms past it."""
    cost = StepCost()
    for size in range(1, 17):
        cost.observe(size, 0.1 + 0.005 * size + (0.05 if size > 4 else 0.0))
    return cost


def test_the_step_cost_follows_the_measured_curve_not_a_line():
    cost = stepped_cost()
    assert cost.seconds(4) == pytest.approx(0.12) and cost.seconds(5) == pytest.approx(0.175)
    cost.observe(3, 0.5)  # slower than the fastest at 3: nothing moves
    cost.observe(20, 1.0)  # a slow size is capped by none larger; it stands
    cost.observe(24, 0.3)  # ... until a larger size is measured faster
    assert cost.seconds(20) == pytest.approx(0.3)
    assert cost.seconds(18) == pytest.approx(0.23 + 0.5 * (0.3 - 0.23))  # between 16 and 20, interpolated
    assert cost.seconds(30) == pytest.approx(0.3 + 6 * cost.line()[1])  # past the sizes measured: the line


def test_drafts_past_a_jump_in_cost_are_taken_when_the_whole_run_pays():
    cost = stepped_cost()
    # 8 drafts at 95%: 7.3 tokens in 0.195 s beat 3 drafts' 3.7 tokens in 0.12 s.
    assert plan_drafts([0.95], [8], 1, cost) == [8]
    # At 60% the jump is not worth it: 3 drafts, 2.2 tokens in 0.12 s.
    assert plan_drafts([0.6], [8], 1, cost) == [3]


def test_a_near_tie_verifies_nothing():
    cost = linear_cost(a=0.1, b=0.01)
    # One draft at acceptance a: 1 + a tokens in 0.12 s against 1 in 0.11 s; it must beat that by MIN_GAIN.
    tie = MIN_GAIN * 0.12 / 0.11 - 1  # 0.2 with MIN_GAIN 1.1
    assert plan_drafts([tie + 0.01], [1], 1, cost) == [1]
    assert plan_drafts([tie - 0.01], [1], 1, cost) == [0]  # better than nothing, but by less than MIN_GAIN


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_incremental_ngram_index_proposes_what_the_rule_does(vocab):
    rng = np.random.default_rng(vocab)
    for min_n, max_n, k in ((1, 3, 3), (2, 5, 8), (2, 2, 1)):
        index = NgramIndex(min_n, max_n)
        tokens = rng.integers(0, vocab, 5).tolist()
        for _ in range(150):
            assert index.propose(tokens, k) == propose_ngram(tokens, min_n, max_n, k), tokens
            tokens += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()  # one token, or a run of accepted ones


def test_a_real_step_replaces_the_calibration_of_its_size():
    cost = StepCost()
    cost.observe(8, 0.10, calibration=True)  # one sequence of 8 rows at start
    cost.observe(12, 0.11, calibration=True)
    assert cost.seconds(10) == pytest.approx(0.105)
    cost.observe(12, 0.20)  # 8 decodes and 4 drafts: the real cost of 12 rows
    cost.observe(12, 0.30)
    assert cost.table() == {8: 0.10, 12: 0.20}
    cost.observe(12, 0.05, calibration=True)  # a calibration never undercuts real steps
    assert cost.seconds(12) == pytest.approx(0.20) and cost.seconds(10) == pytest.approx(0.15)
    cost.observe(8, 0.18)
    assert cost.table() == {8: 0.18, 12: 0.20}


def test_idle_steps_at_once_are_as_many_steps_without_drafts():
    stepped, at_once = Acceptance(), Acceptance()
    for a in (stepped, at_once):
        a.observe(3, 2)
        a.observe(2, 0)  # a miss: a back-off wait starts
    for _ in range(5):
        stepped.observe(0, 0)
    at_once.idle(5)
    assert stepped.rate == pytest.approx(at_once.rate)
    assert (stepped.wait, stepped.num_misses) == (at_once.wait, at_once.num_misses)
    at_once.idle(0)
    assert stepped.rate == pytest.approx(at_once.rate)


def test_a_sizes_fastest_is_the_fastest_still_in_its_window():
    cost = StepCost(window=3)
    for seconds in (0.5, 0.2, 0.4, 0.3):  # 0.5 drops out: 0.2 stays the fastest
        cost.observe(1, seconds)
    assert cost.table() == {1: 0.2}
    cost.observe(1, 0.35)  # 0.2 drops out
    assert cost.table() == {1: 0.3}
    assert cost.seconds(1) == pytest.approx(0.3)
    cost.observe(1, 0.1)
    assert cost.table() == {1: 0.1}


def test_other_decoding_requests_weigh_in_a_steps_yield():
    # One request of eight has a draft: it adds 0.5 expected tokens to eight, not to one.
    cost = linear_cost(a=0.1, b=0.01)
    assert plan_drafts([0.5], [1], 8, cost) == [1]  # alone, 1.5 tokens for 0.19 s beats 1 for 0.18 s
    assert plan_drafts([0.5], [1], 8, cost, num_others=7) == [0]  # 8.5 for 0.19 s is under 1.02 x 8 for 0.18 s
    assert plan_uniform([0.5], [1], 8, cost, lambda k, n: 0.0) == [1]
    assert plan_uniform([0.5], [1], 8, cost, lambda k, n: 0.0, num_others=7) == [0]
