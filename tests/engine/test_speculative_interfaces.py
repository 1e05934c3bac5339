"""Speculative decoding as people reach it: `base run` and `base bench` options and their JSON,
and the chat's stats line."""

from __future__ import annotations

import json

import pytest

from baselm.chat.stats import TurnStats, turn_line
from tests.test_cli import base
from tests.tiny_model import write_model_folder

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("tiny"), eos=False)


def test_run_json_reports_acceptance_and_keeps_greedy_tokens(model_folder):
    args = ("run", str(model_folder), PROMPT, "--json", "--raw", "-n", "12", "-t", "0", "--device", "cpu")
    plain = json.loads(base(*args).stdout)
    result = base(*args, "--speculative", "ngram", "--num-speculative-tokens", "3", "--fixed-speculation")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == plain["token_ids"]
    timings = out["timings"]
    assert timings["spec_draft_tokens"] > 0
    assert 0 <= timings["spec_accepted_tokens"] <= timings["spec_draft_tokens"]
    assert timings["spec_acceptance_rate"] == round(timings["spec_accepted_tokens"] / timings["spec_draft_tokens"], 4)
    assert timings["spec_accepted_tokens_per_step"] >= 1
    assert "spec_acceptance_rate" not in plain["timings"]


def test_bench_json_compares_with_and_without_speculation(model_folder):
    result = base(
        "bench", str(model_folder), "--json", "--device", "cpu", "--concurrency", "1,2", "--prompt-tokens", "16",
        "--gen-tokens", "8", "--speculative", "ngram", "--workload", "grounded,free", "--kv-memory", "8MiB",
        "--spec-repeats", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["speculative"]
    assert spec["speculative"]["method"] == "ngram"
    assert [(r["workload"], r["concurrency"]) for r in spec["runs"]] == [
        ("grounded", 1),
        ("grounded", 2),
        ("free", 1),
        ("free", 2),
    ]
    for row in spec["runs"]:
        assert row["same_tokens"] is True
        assert 0 <= row["acceptance_rate"] <= 1
        assert len(row["speedup_aggregate_pairs"]) == 3
        low, mean, high = row["speedup_pairs_mean_ci95"]
        assert low <= mean <= high and mean == pytest.approx(sum(row["speedup_aggregate_pairs"]) / 3, abs=2e-3)
        assert min(row["speedup_aggregate_pairs"]) <= row["speedup_pairs_median"] <= max(row["speedup_aggregate_pairs"])
    assert spec["step_ms_by_tokens"] and set(spec["step_line_ms"]) == {"a", "b_per_token"}  # a fit of timings
    assert set(spec["auto_off_at_batch"]) == {"0.5", "0.7", "0.9"}


def test_bad_speculative_options_are_one_clear_line(model_folder):
    result = base("run", str(model_folder), "hi", "--speculative", "ngram", "--num-speculative-tokens", "0")
    assert result.returncode == 1 and "num_speculative_tokens" in result.stderr and "Traceback" not in result.stderr
    result = base("bench", str(model_folder), "--speculative", "ngram", "--workload", "poems", "--device", "cpu")
    assert result.returncode == 1 and "workloads" in result.stderr and "Traceback" not in result.stderr


def test_chat_stats_line_shows_acceptance_when_speculating():
    stats = TurnStats(num_prompt_tokens=10, num_output_tokens=20, ttft_s=0.1, total_s=1.0)
    assert "speculative" not in turn_line(stats, 100)
    stats.num_draft_tokens, stats.num_accepted_tokens = 40, 30
    assert "speculative 75% accepted" in turn_line(stats, 100)
