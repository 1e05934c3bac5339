"""The batched Sampler, on tiny hand-made logits."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from baselm.sampling.params import SamplingParams
from baselm.sampling.sampler import Sampler, SamplingRow, _top_k_top_p, _top_k_top_p_sorted, min_tokens_banned_ids

# A 5-token distribution with distinct probabilities; sorted: 1 (.4), 3 (.3), 4 (.15), 2 (.1), 0 (.05).
PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
LOGITS = np.log(PROBS).astype(np.float32)

# An 8-token vocabulary for the penalties.
VOCAB8 = np.array([2.0, -1.0, 0.5, -2.0, 3.0, 1.0, -0.5, 0.0], dtype=np.float32)
PROMPT8 = [0, 1]
OUTPUT8 = [4, 4, 3]


def rows_of(logits: np.ndarray, n: int) -> mx.array:
    return mx.array(np.tile(logits, (n, 1)))  # (n, vocab)


def sample(params: list[SamplingParams], logits: np.ndarray, outputs: list[list[int]] | None = None, seed: int = 0):
    outputs = outputs or [[] for _ in params]
    seqs = [SamplingRow(p, [], out) for p, out in zip(params, outputs)]
    return Sampler(eos_token_ids=[], seed=seed)(mx.array(logits), seqs)


def kept(params: SamplingParams, logits: np.ndarray = LOGITS) -> set[int]:
    """The token ids a draw can still pick after temperature/top-k/top-p/min-p."""
    out = np.array(Sampler().truncate(mx.array(logits[None, :]), [params]))[0]
    return {int(i) for i in np.flatnonzero(np.isfinite(out))}


def processed(params: SamplingParams, prompt: list[int], output: list[int], logits=VOCAB8, eos=()) -> np.ndarray:
    seqs = [SamplingRow(params, prompt, output)]
    return np.array(Sampler(eos_token_ids=eos).process(mx.array(logits[None, :]), seqs))[0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (np.log(np.sum(np.exp(x - x.max()))) + x.max())


# --- greedy and truncation -------------------------------------------------------------


def test_greedy_takes_the_argmax_of_every_row():
    logits = np.array([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 2.9, 1.0], [-5.0, -4.0, -3.0, -3.5]], dtype=np.float32)
    out = sample([SamplingParams(temperature=0.0)] * 3, logits)
    assert out.token_ids.tolist() == [1, 0, 2]
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


def test_a_tiny_temperature_samples_the_argmax():
    logits = np.array([0.0, 1.0, 0.9, -2.0], dtype=np.float32)  # gap of 0.1 -> 100 at T=1e-3
    params = [SamplingParams(temperature=1e-3, seed=s) for s in range(200)]
    out = sample(params, np.tile(logits, (200, 1)))
    assert set(out.token_ids.tolist()) == {1}


def test_top_k_1_equals_greedy_at_a_high_temperature():
    params = [SamplingParams(temperature=2.0, top_k=1, seed=s) for s in range(200)]
    out = sample(params, np.tile(LOGITS, (200, 1)))
    assert set(out.token_ids.tolist()) == {1}


def test_top_k_keeps_the_k_most_likely_tokens():
    assert kept(SamplingParams(top_k=2)) == {1, 3}
    assert kept(SamplingParams(top_k=3)) == {1, 3, 4}
    assert kept(SamplingParams(top_k=0)) == kept(SamplingParams(top_k=-1)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.3, {1}), (0.6, {1, 3}), (0.75, {1, 3, 4}), (0.9, {1, 3, 4, 2}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_that_reaches_the_threshold(top_p, expected):
    assert kept(SamplingParams(top_p=top_p)) == expected


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # top_k=3 leaves .4/.3/.15 -> .47/.35/.18: .47 + .35 = .82 reaches 0.8.
    assert kept(SamplingParams(top_k=3, top_p=0.8)) == {1, 3}


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    assert kept(SamplingParams(min_p=0.3)) == {1, 3, 4}  # >= 0.12
    assert kept(SamplingParams(min_p=0.5)) == {1, 3}  # >= 0.2
    # At T=2 probabilities go as sqrt(p): .632, .548, .387, .316, .224 (unnormalized); 0.55 * .632 = .348.
    assert kept(SamplingParams(temperature=2.0, min_p=0.55)) == {1, 3, 4}


def test_truncation_never_changes_greedy_rows():
    out = np.array(Sampler().truncate(mx.array(LOGITS[None, :]), [SamplingParams(temperature=0, top_k=1)]))[0]
    np.testing.assert_array_equal(out, LOGITS)


def test_sampled_tokens_stay_inside_the_top_p_set():
    params = [SamplingParams(top_p=0.6)] * 2000
    out = sample(params, rows_of(LOGITS, 2000)).token_ids.tolist()
    assert set(out) == {1, 3}


# --- penalties, bias, processors, min_tokens ------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    got = processed(SamplingParams(repetition_penalty=2.0), PROMPT8, OUTPUT8)
    # Seen in prompt+output: 0 (2 -> 1), 1 (-1 -> -2), 3 (-2 -> -4), 4 (3 -> 1.5).
    expected = [1.0, -2.0, 0.5, -4.0, 1.5, 1.0, -0.5, 0.0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_frequency_penalty_subtracts_per_occurrence_in_the_output_only():
    got = processed(SamplingParams(frequency_penalty=0.5), PROMPT8, OUTPUT8)
    # 4 drawn twice (3 - 1.0), 3 once (-2 - 0.5); prompt tokens 0 and 1 untouched.
    expected = [2.0, -1.0, 0.5, -2.5, 2.0, 1.0, -0.5, 0.0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_presence_penalty_subtracts_once_per_token_present_in_the_output():
    got = processed(SamplingParams(presence_penalty=0.5), PROMPT8, OUTPUT8)
    expected = [2.0, -1.0, 0.5, -2.5, 2.5, 1.0, -0.5, 0.0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_penalties_combine_repetition_first_then_frequency_and_presence():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=-0.5)
    got = processed(params, PROMPT8, OUTPUT8)
    # token 4: 3 / 2 - 2 * 0.25 + 0.5 = 1.5; token 3: -2 * 2 - 0.25 + 0.5 = -3.75.
    expected = [1.0, -2.0, 0.5, -3.75, 1.5, 1.0, -0.5, 0.0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_penalties_are_per_row_in_a_batch():
    seqs = [
        SamplingRow(SamplingParams(frequency_penalty=1.0), [], [0, 0]),
        SamplingRow(SamplingParams(), [], [0, 0]),
        SamplingRow(SamplingParams(repetition_penalty=4.0), [5], [7]),
    ]
    got = np.array(Sampler().process(rows_of(VOCAB8, 3), seqs))
    np.testing.assert_allclose(got[0], [0.0, -1.0, 0.5, -2.0, 3.0, 1.0, -0.5, 0.0], atol=1e-6)
    np.testing.assert_allclose(got[1], VOCAB8, atol=0)
    np.testing.assert_allclose(got[2], [2.0, -1.0, 0.5, -2.0, 3.0, 0.25, -0.5, 0.0], atol=1e-6)


def test_logit_bias_adds_to_the_named_tokens():
    got = processed(SamplingParams(logit_bias={2: 5.0, 7: -100.0}), [], [])
    expected = [2.0, -1.0, 5.5, -2.0, 3.0, 1.0, -0.5, -100.0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert sample([SamplingParams(temperature=0, logit_bias={2: 5.0})], VOCAB8[None, :]).token_ids.tolist() == [2]


def test_logits_processors_see_the_output_ids_and_raw_logits_before_the_bias():
    seen: list[tuple[list[int], list[float]]] = []

    def only_token_6(token_ids: list[int], logits: mx.array) -> mx.array:
        seen.append((token_ids, logits.tolist()))
        return mx.where(mx.arange(logits.shape[0]) == 6, logits, -mx.inf)

    params = SamplingParams(logits_processors=[only_token_6], logit_bias={4: 1.0}, temperature=2.0, seed=1)
    out = Sampler()(mx.array(VOCAB8[None, :]), [SamplingRow(params, [9], [3, 5])])
    assert out.token_ids.tolist() == [6]
    assert seen == [([3, 5], VOCAB8.tolist())]


def test_min_tokens_masks_eos_and_stop_ids_until_enough_tokens_exist():
    params = SamplingParams(min_tokens=2, stop_token_ids=[6])
    early = processed(params, [], [4], eos=[7])
    assert np.isneginf(early[[6, 7]]).all() and np.isfinite(early[:6]).all()
    np.testing.assert_array_equal(processed(params, [], [4, 4], eos=[7]), VOCAB8)
    assert min_tokens_banned_ids(params, [7]) == [6, 7]
    assert min_tokens_banned_ids(SamplingParams(min_tokens=2, stop_token_ids=[6], ignore_eos=True), [7]) == [6]
    assert min_tokens_banned_ids(SamplingParams(stop_token_ids=[6]), [7]) == []


def test_min_tokens_keeps_a_greedy_request_off_eos():
    params = SamplingParams(temperature=0, min_tokens=1)
    seqs = [SamplingRow(params, [], []), SamplingRow(params, [], [1])]
    out = Sampler(eos_token_ids=[4])(rows_of(VOCAB8, 2), seqs)
    assert out.token_ids.tolist() == [0, 4]


# --- logprobs --------------------------------------------------------------------------


def test_logprobs_match_log_softmax_of_the_processed_logits():
    params = SamplingParams(logprobs=3, repetition_penalty=2.0, seed=3)
    out = Sampler()(mx.array(VOCAB8[None, :]), [SamplingRow(params, PROMPT8, OUTPUT8)])
    ref = log_softmax(processed(params, PROMPT8, OUTPUT8))
    (row,) = out.row_logprobs()
    assert row.token_id == out.token_ids.item()
    assert row.logprob == pytest.approx(ref[row.token_id], abs=1e-6)
    best = np.argsort(-ref)[:3]
    assert [t for t, _ in row.top] == best.tolist()
    np.testing.assert_allclose([lp for _, lp in row.top], ref[best], atol=1e-6)


def test_logprobs_over_the_whole_vocabulary_sum_to_one():
    out = sample([SamplingParams(logprobs=8, temperature=0.7)], VOCAB8[None, :])
    (row,) = out.row_logprobs()
    assert sorted(t for t, _ in row.top) == list(range(8))
    assert math.fsum(math.exp(lp) for _, lp in row.top) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_do_not_depend_on_temperature_or_truncation():
    hot = sample([SamplingParams(logprobs=4, temperature=2.0)], VOCAB8[None, :]).row_logprobs()[0]
    cut = sample([SamplingParams(logprobs=4, temperature=0.3, top_k=2)], VOCAB8[None, :]).row_logprobs()[0]
    assert [t for t, _ in hot.top] == [t for t, _ in cut.top] == [4, 0, 5, 2]
    np.testing.assert_allclose([lp for _, lp in hot.top], [lp for _, lp in cut.top], atol=1e-6)


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing():
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0), SamplingParams(logprobs=2)]
    rows = sample(params, rows_of(VOCAB8, 3)).row_logprobs()
    assert rows[0].token_id == 4 and rows[0].top == []
    assert rows[0].logprob == pytest.approx(log_softmax(VOCAB8)[4], abs=1e-6)
    assert rows[1] is None
    assert len(rows[2].top) == 2
    assert sample([SamplingParams()], VOCAB8[None, :]).logprobs is None


# --- seeds and the distribution --------------------------------------------------------


def generate(sampler: Sampler, rows: list[SamplingRow], steps: int, logits_per_step: list[np.ndarray], watch: int):
    """Runs `steps` steps over a batch, appending each draw; returns row `watch`'s output."""
    for step in range(steps):
        logits = np.stack([logits_per_step[(step + i) % len(logits_per_step)] for i in range(len(rows))])
        ids = sampler(mx.array(logits), rows).token_ids.tolist()
        for row, token_id in zip(rows, ids):
            row.output_token_ids.append(token_id)
    return rows[watch].output_token_ids


STEP_LOGITS = [np.random.default_rng(i).normal(size=50).astype(np.float32) * 0.5 for i in range(7)]


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch():
    alone = generate(Sampler(seed=1), [SamplingRow(SamplingParams(seed=42), [], [])], 20, STEP_LOGITS, 0)
    # In a batch: the watched row sits third, so the step -> logits mapping must line up with `alone`.
    shifted = STEP_LOGITS[-2:] + STEP_LOGITS[:-2]
    batch = [
        SamplingRow(SamplingParams(), [], [3, 3, 3]),
        SamplingRow(SamplingParams(seed=7, top_k=5), [], [1]),
        SamplingRow(SamplingParams(seed=42), [], []),
        SamplingRow(SamplingParams(temperature=0), [], [2, 2]),
    ]
    together = generate(Sampler(seed=99), batch, 20, shifted, 2)
    assert together == alone
    assert len(set(alone)) > 5  # the draws really vary


def test_a_seeded_request_resumes_identically_from_any_step():
    full = generate(Sampler(), [SamplingRow(SamplingParams(seed=5), [], [])], 12, STEP_LOGITS, 0)
    # Step 7 of the full run used STEP_LOGITS[7 % 7] = STEP_LOGITS[0], as does step 0 here.
    resumed = generate(Sampler(), [SamplingRow(SamplingParams(seed=5), [], full[:7])], 5, STEP_LOGITS, 0)
    assert resumed == full


def test_a_seeded_request_draws_fresh_noise_at_every_step():
    flat = [np.zeros(50, dtype=np.float32)]
    out = generate(Sampler(), [SamplingRow(SamplingParams(seed=3), [], [])], 20, flat, 0)
    assert len(set(out)) > 10  # 20 uniform draws over 50 tokens repeat rarely


def test_different_seeds_draw_different_tokens():
    a = generate(Sampler(), [SamplingRow(SamplingParams(seed=1), [], [])], 30, STEP_LOGITS, 0)
    b = generate(Sampler(), [SamplingRow(SamplingParams(seed=2), [], [])], 30, STEP_LOGITS, 0)
    assert sum(x == y for x, y in zip(a, b)) < 8  # ~1/50 of positions agree by chance


def test_unseeded_draws_follow_the_softmax_distribution():
    out = sample([SamplingParams()] * 20000, rows_of(LOGITS, 20000), seed=0).token_ids.tolist()
    freq = np.bincount(out, minlength=5) / 20000
    assert np.abs(freq - PROBS).max() < 0.02


def test_tempered_truncated_draws_follow_the_renormalized_distribution():
    params = [SamplingParams(temperature=0.5, top_k=3)] * 20000
    out = sample(params, rows_of(LOGITS, 20000), seed=1).token_ids.tolist()
    target = np.zeros(5)
    target[[1, 3, 4]] = PROBS[[1, 3, 4]] ** 2  # T=0.5 squares the probabilities
    target /= target.sum()
    assert np.abs(np.bincount(out, minlength=5) / 20000 - target).max() < 0.02


def test_seeded_draws_follow_the_softmax_distribution():
    params = [SamplingParams(seed=s) for s in range(4000)]
    out = sample(params, rows_of(LOGITS, 4000)).token_ids.tolist()
    assert np.abs(np.bincount(out, minlength=5) / 4000 - PROBS).max() < 0.03


def test_logits_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="2 sequences"):
        Sampler()(mx.zeros((3, 8)), [SamplingRow(SamplingParams())] * 2)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (40, 1.0), (40, 0.5), (600, 0.95), (0, 0.999999)])
def test_candidate_top_k_top_p_equals_the_full_sort(top_k, top_p):
    vocab = 4096
    sharp = mx.random.normal((3, vocab), key=mx.random.key(1)) * 4.0  # nucleus inside the candidates
    flat = mx.random.normal((1, vocab), key=mx.random.key(2)) * 0.1  # nucleus far beyond them
    x = mx.concatenate([sharp, flat])
    k = mx.array([top_k if top_k else vocab] * 4)
    p = mx.array([top_p if top_p < 1.0 else 2.0] * 4)
    fast = _top_k_top_p(x, k, p)
    full = _top_k_top_p_sorted(x, mx.argsort(-x, axis=-1), k, p)
    assert mx.array_equal(mx.isinf(fast), mx.isinf(full)).item()
    assert mx.array_equal(mx.where(mx.isinf(full), 0, fast), mx.where(mx.isinf(full), 0, full)).item()


@pytest.mark.parametrize("top_k, top_p", [(40, 0.95), (512, 0.5), (1, 1.0)])
def test_a_top_k_within_the_candidates_needs_no_check_and_equals_the_full_sort(top_k, top_p):
    vocab = 4096
    flat = mx.random.normal((2, vocab), key=mx.random.key(3)) * 0.1  # top_p alone would reach past the candidates
    k, p = mx.array([top_k] * 2), mx.array([top_p if top_p < 1.0 else 2.0] * 2)
    fast = _top_k_top_p(flat, k, p, within=True)
    full = _top_k_top_p_sorted(flat, mx.argsort(-flat, axis=-1), k, p)
    assert mx.array_equal(mx.where(mx.isinf(full), 0, fast), mx.where(mx.isinf(full), 0, full)).item()
    assert mx.array_equal(mx.isinf(fast), mx.isinf(full)).item()
