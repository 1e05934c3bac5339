"""Perplexity: sliding windows score every token once, and the numbers are those of plain forwards."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from baselm.cli import app
from baselm.perplexity import PerplexityError, Window, check_window, perplexity, plan_windows, token_nlls
from tests.forward import prefill_logits
from tests.paths import TEXT_FIXTURES
from tests.tiny_model import loaded_fixture

TEXT = TEXT_FIXTURES / "alice_chapter1.txt"
# The tiny model's vocabulary is 256 ids; fixed pseudo-random ids stand in for a text.
TOKEN_IDS = [int(i) for i in np.random.default_rng(7).integers(0, 256, size=40)]
TOL = 1e-4


def full_forward_nlls(token_ids: list[int]) -> np.ndarray:
    """-log softmax of one forward over all of `token_ids` at each next token, in float64."""
    model = loaded_fixture().model
    n = len(token_ids)
    logits = prefill_logits(model, token_ids, block_size=16).astype(np.float64)  # (n, vocab)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (n, vocab)
    return -log_probs[np.arange(n - 1), token_ids[1:]]  # (n - 1,)


def test_one_window_gives_exp_of_the_full_forward_mean_nll():
    expected = full_forward_nlls(TOKEN_IDS).mean()
    result = perplexity(loaded_fixture().model, TOKEN_IDS, context=64)
    assert result.num_windows == 1
    assert result.num_scored == 39
    assert result.mean_nll == pytest.approx(expected, abs=TOL)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=TOL)


def test_each_window_scores_its_targets_as_a_forward_over_the_window():
    nlls, windows = token_nlls(loaded_fixture().model, TOKEN_IDS, context=16, stride=6)
    expected = np.concatenate(
        [full_forward_nlls(TOKEN_IDS[w.start : w.end])[w.first_target - w.start - 1 :] for w in windows]
    )
    assert nlls.shape == (39,)
    np.testing.assert_allclose(nlls, expected, atol=TOL)


def test_sliding_windows_plan_is_exact():
    assert plan_windows(40, context=16, stride=8) == [
        Window(0, 16, 1),
        Window(8, 24, 16),
        Window(16, 32, 24),
        Window(24, 40, 32),
    ]


@pytest.mark.parametrize(
    "num_tokens, context, stride", [(2, 2, 1), (40, 16, 15), (40, 16, 1), (100, 7, 3), (10, 64, 32)]
)
def test_sliding_windows_score_every_target_exactly_once(num_tokens, context, stride):
    windows = plan_windows(num_tokens, context, stride)
    targets = [t for w in windows for t in range(w.first_target, w.end)]
    assert targets == list(range(1, num_tokens))
    assert all(w.end - w.start <= context and w.first_target > w.start for w in windows)


def test_result_counts_scored_and_evaluated_tokens():
    result = perplexity(loaded_fixture().model, TOKEN_IDS, context=16, stride=8)
    assert (result.num_scored, result.num_evaluated, result.num_windows) == (39, 64, 4)
    assert result.perplexity == pytest.approx(math.exp(result.mean_nll), rel=1e-12)


def test_quantized_kv_pools_stay_close_to_float_pools():
    model = loaded_fixture().model
    float_nlls, _ = token_nlls(model, TOKEN_IDS, context=16, stride=8)
    # Mean NLL bounds about 5x the shifts measured on this fixture (q8: 0.0009, q4: 0.012, of 6.04).
    for bits, tol in ((8, 0.005), (4, 0.05)):
        nlls, _ = token_nlls(model, TOKEN_IDS, context=16, stride=8, kv_bits=bits)
        assert not np.array_equal(nlls, float_nlls)  # the quantized pools were really used
        assert abs(nlls.mean() - float_nlls.mean()) < tol


@pytest.mark.parametrize(
    "context, stride, max_context, message",
    [
        (1, 1, None, "context must be at least 2 tokens, got 1"),
        (16, 0, None, "stride must be at least 1 and less than the context (16), got 0"),
        (16, 16, None, "stride must be at least 1 and less than the context (16), got 16"),
        (1024, 512, 512, "context 1024 is longer than the model's 512 positions; pass --context 512 or less"),
    ],
)
def test_bad_context_or_stride_is_refused(context, stride, max_context, message):
    with pytest.raises(PerplexityError, match=re.escape(message)):
        check_window(context, stride, max_context)


def test_a_one_token_text_is_refused():
    with pytest.raises(PerplexityError, match=re.escape("the text has 1 token(s); perplexity needs at least 2")):
        perplexity(loaded_fixture().model, [5], context=16)


def test_unknown_kv_bits_is_refused():
    with pytest.raises(PerplexityError, match=re.escape("kv_bits must be one of 16, 8, 4, got 3")):
        perplexity(loaded_fixture().model, TOKEN_IDS, context=16, kv_bits=3)


def test_cli_reports_a_bad_stride_in_one_line(tmp_path):
    args = ["perplexity", str(tmp_path / "none.base"), str(TEXT), "--context", "8", "--stride", "8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "error: stride must be at least 1 and less than the context (8), got 8" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_smollm2_perplexity_on_a_short_passage(smollm2_gguf, tmp_path):
    passage = tmp_path / "passage.txt"
    passage.write_text(TEXT.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    args = ["perplexity", str(smollm2_gguf), str(passage), "--context", "128", "--json", "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert 200 < report["num_scored"] < 300
    assert report["context"] == 128 and report["stride"] == 64
    # A uniform guess over the 49,152-token vocabulary scores 49,152; the model reads this passage far better.
    assert math.isfinite(report["perplexity"]) and 1 < report["perplexity"] < 100
