"""The n-gram proposer and the rule that sizes each request's drafts from measured costs."""

from __future__ import annotations

from baselm.spec.ngram import propose_ngram
from baselm.spec.policy import Acceptance, StepCost, expected_tokens, plan_drafts, plan_uniform


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


def flat_then_linear() -> StepCost:
    """1 ms up to 8 tokens (memory-bound), then 1 ms more per 8 tokens."""
    cost = StepCost()
    for size in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(size, 0.001 * max(1.0, size / 8))
    return cost


def test_step_cost_interpolates_keeps_the_fastest_and_never_decreases():
    cost = flat_then_linear()
    assert cost.seconds(12) == 0.0015
    cost.observe(16, 0.5)  # a slow outlier (a busy machine) does not raise the estimate
    assert cost.seconds(16) == 0.002
    cost.observe(4, 0.0005)  # faster than 8 tokens: the curve stays non-decreasing from there
    assert cost.seconds(2) == 0.001 and cost.seconds(4) == 0.001
    assert cost.seconds(128) == 0.016  # beyond the largest size: in proportion


def test_free_rows_are_speculated_and_costly_batches_switch_it_off():
    cost = flat_then_linear()
    # One stream, rows free up to 8 tokens: every draft up to k pays.
    assert plan_drafts([0.5], [4], 1, cost) == [4]
    # 32 streams, where the step time grows in proportion to its tokens: a row costs as much
    # as a token it might emit, so no acceptance below 1 pays.
    assert plan_drafts([0.9] * 32, [4] * 32, 32, cost) == [0] * 32
    # 4 streams: the rows up to 8 tokens are free, past that no draft pays.
    counts = plan_drafts([0.9] * 4, [4] * 4, 4, cost)
    assert sum(counts) == 4
    # Better requests get their drafts first.
    counts = plan_drafts([0.9, 0.3], [4, 4], 60, cost)
    assert counts[0] >= counts[1]


def test_nothing_is_planned_before_anything_is_measured():
    assert plan_drafts([0.9], [4], 1, StepCost()) == [0]


def test_a_draft_model_that_costs_as_much_as_the_target_is_not_worth_it():
    cost = flat_then_linear()
    same = plan_uniform([0.99], [4], 1, cost, lambda k, n: k * cost.seconds(n))
    assert same == [0]
    cheap = plan_uniform([0.8], [4], 1, cost, lambda k, n: k * 0.1 * cost.seconds(n))
    assert cheap[0] > 0


def test_acceptance_counts_only_tested_drafts_and_returns_to_the_prior():
    a = Acceptance()
    prior = a.rate
    a.observe(4, 0)  # rejected at the first: one draft tested
    assert a.verified == 1 and a.rate < prior
    for _ in range(200):
        a.observe(0, 0)
    assert abs(a.rate - prior) < 1e-6
    assert expected_tokens(0.5, 2) == 1.75
