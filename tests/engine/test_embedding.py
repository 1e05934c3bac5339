"""Embeddings pooled from the engine's model, computed in borrowed pool blocks between steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.config import EngineConfig
from baselm.embedding import EmbeddingError, default_pooling, embed
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.forward import prefill_logits
from tests.tiny_model import loaded_widened_llama

INPUTS = [[5, 9, 17, 3, 44, 2, 8, 21, 6], [11, 12], [7] * 19, [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(loaded_widened_llama("tiny"), EngineConfig(kv_memory=2**20, block_size=8))


def test_last_token_pooling_is_the_hidden_state_the_lm_head_reads(engine: LLMEngine) -> None:
    model = engine.runner.model
    for ids in INPUTS:
        (vector,) = embed(engine, [ids], "last", normalize=False)
        logits = np.array(model.lm_logits(mx.array(vector)[None]))[0]
        np.testing.assert_allclose(logits, prefill_logits(model, ids)[-1], rtol=1e-4, atol=1e-4)


def test_batching_and_budget_splits_do_not_change_a_vector(engine: LLMEngine) -> None:
    alone = [embed(engine, [ids], "mean", normalize=False)[0] for ids in INPUTS]
    together = embed(engine, INPUTS, "mean", normalize=False)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    small_budget = LLMEngine(engine.loaded, EngineConfig(kv_memory=2**20, block_size=8, max_num_batched_tokens=8))
    split = embed(small_budget, INPUTS, "mean", normalize=False)  # one forward per input here
    for a, b in zip(alone, split):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_mean_pooling_averages_and_normalizing_scales_to_length_one(engine: LLMEngine) -> None:
    ids = INPUTS[0]
    prefixes = [embed(engine, [ids[: i + 1]], "last", normalize=False)[0] for i in range(len(ids))]
    (mean,) = embed(engine, [ids], "mean", normalize=False)
    np.testing.assert_allclose(mean, np.mean(prefixes, axis=0), rtol=1e-4, atol=1e-5)
    (unit,) = embed(engine, [ids], "mean", normalize=True)
    assert abs(np.linalg.norm(unit) - 1.0) < 1e-5
    np.testing.assert_allclose(unit, mean / np.linalg.norm(mean), rtol=1e-5, atol=1e-6)


def test_embedding_between_requests_changes_no_answer_and_returns_every_block(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    before = engine.generate([[5, 9, 17, 3]], params)[0].completions[0].token_ids
    free = engine.kv_manager.num_free_blocks
    embed(engine, INPUTS, "mean", normalize=True)
    assert engine.kv_manager.num_free_blocks == free
    assert engine.generate([[5, 9, 17, 3]], params)[0].completions[0].token_ids == before


def test_bad_inputs_are_refused_clearly(engine: LLMEngine) -> None:
    with pytest.raises(EmbeddingError, match="empty"):
        embed(engine, [[1, 2], []], "mean", normalize=True)
    with pytest.raises(EmbeddingError, match="pooling"):
        embed(engine, [[1, 2]], "max", normalize=True)
    with pytest.raises(EmbeddingError, match="at most"):
        embed(engine, [[1] * (engine.max_model_len + 1)], "mean", normalize=True)
    pool = engine.kv_manager.pool
    free = pool.num_free_blocks
    held = pool.allocate(free - 1)  # as if running requests held all blocks but one
    try:
        with pytest.raises(EmbeddingError, match="free blocks"):
            embed(engine, [[3] * (engine.kv_manager.block_size + 1)], "mean", normalize=True)
        assert pool.num_free_blocks == 1
    finally:
        pool.free(held)
    assert pool.num_free_blocks == free


def test_default_pooling_follows_how_the_checkpoint_was_saved() -> None:
    assert default_pooling({"architectures": ["LlamaForCausalLM"]}) == "mean"
    assert default_pooling({"architectures": ["Qwen3Model"]}) == "last"
    assert default_pooling({}) == "mean"
