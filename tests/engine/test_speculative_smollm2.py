"""SmolLM2 with speculative decoding gives transformers' greedy reference tokens, batched.

The reference (tests/fixtures, or ../shared/reference) is what SmolLM2 generates greedily; the
plain engine reproduces all 32 tokens of every case (tests/models/test_smollm2.py). Verifying
drafts computes several positions in one forward, which must not change one token: with the
n-gram proposer and with SmolLM2 as its own draft model (every draft accepted).
"""

from __future__ import annotations

import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf, select_backend("cpu"))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batch_of_8_with_speculation_gives_the_reference_tokens(smollm2, smollm2_reference, method):
    spec = SpeculativeConfig(method, "self" if method == "draft" else None, num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(
        smollm2, EngineConfig(kv_memory=64 * 2**20, speculative=spec), smollm2 if method == "draft" else None
    )
    cases = smollm2_reference["cases"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = engine.generate([c["prompt_token_ids"] for c in cases], params)
    for case, result in zip(cases, results):
        expected = case["generated_token_ids"]
        assert result.completions[0].token_ids[: len(expected)] == expected, case["prompt"]
    stats = engine.spec_stats()
    assert stats.num_draft_tokens > 0
    if method == "draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
