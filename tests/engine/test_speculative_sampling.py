"""Speculative sampling draws from the target's distribution, exactly.

The first 3 tokens of a request are sampled many times under different seeds, with a draft
model whose distribution q differs from the target's p and with n-gram proposals; their
empirical joint distribution must lie within a total-variation bound of the exact one,
computed from the model's logits through the same sampling parameters (temperature, top-k,
logit bias). Token 1 comes from the prompt's step; tokens 2 and 3 from one verification
step (accept, residual and bonus paths all occur).

The bound, for n independent draws from P over outcomes i:
  E[TV(P_n, P)] = 1/2 sum_i E|p_n(i) - p(i)| <= 1/2 sum_i sqrt(p(i) (1 - p(i)) / n),
and TV(P_n, P) changes by at most 1/n when one draw changes, so by McDiarmid's inequality
  P(TV(P_n, P) >= E[TV] + eps) <= exp(-2 n eps^2);
eps = sqrt(ln(1e9) / (2n)) puts that chance at 1e-9. The seeds are fixed, so the test is
deterministic; the bound says a correct sampler passes it for all but a 1e-9 share of seeds.
The wrong rule "accept every draft" would give tokens 2 and 3 from q: that distribution is
checked to lie far outside the bound, so the test can tell.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from baselm.sampling.sampler import Sampler, SamplingRow
from tests.forward import prefill_logits
from tests.tiny_model import loaded_fixture

NUM_RUNS = 3000
PROMPT = [10, 20, 30, 40, 5] * 4
# Strong biases put both models' top 4 on the same tokens, with different weights (p != q).
PARAMS = dict(temperature=1.0, top_k=4, logit_bias={10: 7.0, 20: 6.5, 30: 6.0, 40: 6.0}, max_tokens=3)
# Penalties change p at row j by the drafts before it: a row that did not count them would
# draw token 3 from the wrong distribution.
PENALIZED = dict(PARAMS, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


def next_distribution(model, output: tuple[int, ...], params_dict: dict = PARAMS) -> np.ndarray:
    """p(. | prompt + output) after the request's sampling parameters, (vocab,)."""
    params = SamplingParams(**params_dict)
    logits = mx.array(prefill_logits(model, PROMPT + list(output))[-1:])
    sampler = Sampler()
    rows = [SamplingRow(params, PROMPT, list(output))]
    return np.array(mx.softmax(sampler.truncate(sampler.process(logits, rows), [params]), axis=-1))[0]


def exact_joint(first, rest, params_dict: dict = PARAMS) -> dict[tuple[int, ...], float]:
    """The distribution of the first 3 tokens: token 1 from `first`'s model, tokens 2 and 3 from `rest`'s."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for position in range(3):
        model = first if position == 0 else rest
        grown = {}
        for prefix, mass in joint.items():
            p = next_distribution(model, prefix, params_dict)
            for token_id in np.flatnonzero(p > 0):
                grown[(*prefix, int(token_id))] = mass * float(p[token_id])
        joint = grown
    return joint


def tv_bound(joint: dict[tuple[int, ...], float], n: int) -> float:
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in joint.values())
    return mean + math.sqrt(math.log(1e9) / (2 * n))


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def empirical(
    spec: SpeculativeConfig, draft, params_dict: dict = PARAMS
) -> tuple[dict[tuple[int, ...], float], LLMEngine]:
    config = EngineConfig(
        kv_memory=32 * 2**20, max_num_seqs=256, max_num_batched_tokens=4096, max_waiting=NUM_RUNS, speculative=spec
    )
    engine = LLMEngine(loaded_fixture(), config, draft)
    params = [SamplingParams(seed=seed, **params_dict) for seed in range(NUM_RUNS)]
    results = engine.generate([PROMPT] * NUM_RUNS, params)
    counts: dict[tuple[int, ...], float] = {}
    for result in results:
        key = tuple(result.completions[0].token_ids)
        counts[key] = counts.get(key, 0) + 1 / NUM_RUNS
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return counts, engine


@pytest.fixture(scope="module")
def target_joint():
    model = loaded_fixture().model
    return exact_joint(model, model)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_first_three_tokens_follow_the_target(proposer, target_joint):
    spec = SpeculativeConfig(
        proposer, "qwen2" if proposer == "draft" else None, num_speculative_tokens=2, adaptive=False
    )
    draft = loaded_fixture("qwen2") if proposer == "draft" else None
    counts, engine = empirical(spec, draft)
    bound = tv_bound(target_joint, NUM_RUNS)
    tv = total_variation(counts, target_joint)
    print(f"TV {tv:.4f} within {bound:.4f}")
    assert tv < bound
    stats = engine.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both acceptance and rejection happen


def test_accepting_every_draft_would_fail_the_bound(target_joint):
    target, draft = loaded_fixture().model, loaded_fixture("qwen2").model
    wrong = exact_joint(target, draft)
    assert total_variation(wrong, target_joint) > 3 * tv_bound(target_joint, NUM_RUNS)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_with_penalties_the_first_three_tokens_follow_the_target(proposer):
    model = loaded_fixture().model
    exact = exact_joint(model, model, PENALIZED)
    spec = SpeculativeConfig(
        proposer, "qwen2" if proposer == "draft" else None, num_speculative_tokens=2, adaptive=False
    )
    counts, engine = empirical(spec, loaded_fixture("qwen2") if proposer == "draft" else None, PENALIZED)
    tv = total_variation(counts, exact)
    print(f"TV {tv:.4f} within {tv_bound(exact, NUM_RUNS):.4f}")
    assert tv < tv_bound(exact, NUM_RUNS)
    assert total_variation(exact, exact_joint(model, model)) > 3 * tv_bound(exact, NUM_RUNS)  # penalties matter here
    stats = engine.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
