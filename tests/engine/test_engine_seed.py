"""`EngineConfig.seed` (`base serve --seed`): requests that bring no seed sample the same way each run."""

from __future__ import annotations

from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.tiny_model import loaded_widened_llama

PROMPTS = [[5, 9, 13, 17], [40, 41, 42]]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no seed of its own


def answers(seed: int) -> list[list[int]]:
    engine = LLMEngine(loaded_widened_llama("tiny"), EngineConfig(kv_memory=2**20, seed=seed))
    return [result.completions[0].token_ids for result in engine.generate(PROMPTS, SAMPLED)]


def test_an_engine_seed_makes_unseeded_sampling_repeat_and_other_seeds_differ() -> None:
    first = answers(3)
    assert answers(3) == first
    assert any(answers(seed) != first for seed in (4, 5))  # 12 tokens at temperature 1: a repeat by chance is ~0
