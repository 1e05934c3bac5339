"""The real Gemma 3 270M Q4_K_M GGUF against transformers' greedy reference (tests/fixtures).

transformers ran the file's weights exactly dequantized, in float32
(tests/tools/make_gemma_reference.py). base keeps the file's blocks as they are (Q4_K and Q6_K on
the CPU kernels as blocks, Q5_0 and Q8_0 as exact affine triplets; a pulled copy requantizes the nine
Q6_K tensors to 8 bits) and sums in another order than transformers, so a step whose top-2 margin
is small may flip: the tokens must match up to the first step whose
reference margin is under 0.05, and the first step's log-probabilities within 0.05.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from tests.models.test_smollm2 import greedy
from tests.paths import FIXTURES
from tests.test_cli import base

pytestmark = pytest.mark.slow
REFERENCE = json.loads((FIXTURES / "gemma3_transformers_greedy.json").read_text(encoding="utf-8"))
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    return load_model(gemma3_gguf, select_backend("cpu"))


def sure_steps(case: dict) -> int:
    """Steps before the first near-tie: where any exact-enough model picks the reference's token."""
    margins = case["top2_margin"]
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=["raw", "turns"])
def test_greedy_tokens_match_transformers_up_to_the_first_near_tie(gemma3, case):
    num_sure = sure_steps(case)
    assert num_sure >= 9
    assert gemma3.tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]
    tokens, _ = greedy(gemma3.model, case["prompt_token_ids"], num_sure)
    assert tokens == case["generated_token_ids"][:num_sure]


def test_first_step_logprobs_match_transformers(gemma3):
    case = REFERENCE["cases"][0]
    _, logits = greedy(gemma3.model, case["prompt_token_ids"], 1)
    logprobs = logits[0] - mx.logsumexp(logits[0])
    for token_id, expected in case["top5_logprobs_first"]:
        assert abs(logprobs[token_id].item() - expected) < 0.05


def test_pulled_and_run_by_name_it_answers_as_transformers_does(gemma3_gguf, tmp_path):
    # The CLI end to end: the GGUF into a store as a `.base` file (its tokenizer kept in the header),
    # then run by name; the reference's first 8 tokens are all sure steps.
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    pulled = base("pull", str(gemma3_gguf), "--quiet", env=env, timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    name = pulled.stdout.strip()
    case = REFERENCE["cases"][0]
    result = base("run", name, case["prompt"], "-n", "8", "-t", "0", "--device", "cpu", env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" the capital of the country of France.")
