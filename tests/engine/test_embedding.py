"""Embeddings pooled from the engine's model, computed in borrowed pool blocks a slice at a time between steps."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from baselm.config import EngineConfig
from baselm.embedding import MAX_INPUTS, EmbeddingError, EmbeddingQueue, default_pooling, embed
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.forward import prefill_logits
from tests.paths import FIXTURES
from tests.tiny_model import loaded_widened_llama

INPUTS = [[5, 9, 17, 3, 44, 2, 8, 21, 6], [11, 12], [7] * 19, [30, 31, 32, 33, 34]]
BEFORE_SLICES = json.loads((FIXTURES / "embeddings" / "tiny_llama.json").read_text())


def engine_with_budget(max_num_batched_tokens: int) -> LLMEngine:
    config = EngineConfig(kv_memory=2**20, block_size=8, max_num_batched_tokens=max_num_batched_tokens)
    return LLMEngine(loaded_widened_llama("tiny"), config)


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


def test_vectors_are_those_the_one_call_implementation_gave(engine: LLMEngine) -> None:
    # Within float32 rounding: the fixture was made on one machine, the BLAS kernels differ by ISA.
    assert BEFORE_SLICES["inputs"] == INPUTS
    for pooling in ("mean", "last"):
        vectors = embed(engine, INPUTS, pooling, normalize=False)
        np.testing.assert_allclose(vectors, BEFORE_SLICES[pooling], rtol=1e-5, atol=1e-6)
    vectors = embed(engine_with_budget(8), INPUTS, "mean", normalize=True)
    np.testing.assert_allclose(vectors, BEFORE_SLICES["mean_normalized_budget_8"], rtol=1e-5, atol=1e-6)


def test_a_request_is_cut_into_slices_of_whole_inputs_within_the_step_budget() -> None:
    engine = engine_with_budget(20)
    request = EmbeddingQueue(engine).add("e", INPUTS, "mean", normalize=False)
    assert request.slices == [range(0, 2), range(2, 3), range(3, 4)]  # 9 + 2 tokens, 19, 5 (19 + 5 > 20)


def test_generation_steps_between_slices_change_no_vector(engine: LLMEngine) -> None:
    busy = engine_with_budget(16)
    idle = embed(busy, INPUTS * 3, "mean", normalize=True)
    queue = EmbeddingQueue(busy)
    request = queue.add("e", INPUTS * 3, "mean", normalize=True)
    busy.add_request([5, 9, 17, 3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while not request.is_finished:
        assert queue.step() is request
        busy.step()
    assert len(request.slices) > 1 and busy.has_unfinished  # the completion ran beside every slice
    assert all(np.array_equal(a, b) for a, b in zip(idle, request.vectors, strict=True))
    assert not queue.has_unfinished


def test_requests_take_turns_one_slice_each() -> None:
    engine = engine_with_budget(8)
    queue = EmbeddingQueue(engine)
    big = queue.add("big", INPUTS * 5, "mean", normalize=True)  # 20 slices
    small = queue.add("small", INPUTS[:2], "mean", normalize=True)  # 2 slices
    ran = [queue.step().request_id for _ in range(4)]
    assert ran == ["big", "small", "big", "small"]
    assert small.is_finished and "small" not in queue and big.num_slices_done == 2


def test_an_aborted_request_runs_no_more_slices() -> None:
    engine = engine_with_budget(8)
    queue = EmbeddingQueue(engine)
    request = queue.add("e", INPUTS * 5, "mean", normalize=True)
    queue.step()
    queue.abort("e")
    assert queue.step() is None and not queue.has_unfinished
    assert request.num_slices_done == 1 and len(request.vectors) == 1


def test_a_slice_waits_for_free_blocks_and_runs_once_they_are_back(engine: LLMEngine) -> None:
    pool = engine.kv_manager.pool
    queue = EmbeddingQueue(engine)
    request = queue.add("e", [[3] * (engine.kv_manager.block_size + 1)], "mean", normalize=True)  # needs 2 blocks
    held = pool.allocate(pool.num_free_blocks - 1)  # as if running requests held all blocks but one
    try:
        assert queue.step() is None and request.num_slices_done == 0
    finally:
        pool.free(held)
    assert queue.step() is request and request.is_finished


def test_too_many_inputs_are_refused_before_any_work(engine: LLMEngine) -> None:
    with pytest.raises(EmbeddingError, match=f"holds {MAX_INPUTS + 1} inputs; the limit is {MAX_INPUTS}"):
        EmbeddingQueue(engine).add("e", [[1]] * (MAX_INPUTS + 1), "mean", normalize=True)
