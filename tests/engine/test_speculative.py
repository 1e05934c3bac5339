"""Speculative decoding never changes a greedy answer, and gives every block back.

Each test runs the same requests through a plain engine and a speculating one and asks
for the same tokens: alone, 16 at once with staggered arrivals and shared prefixes (prefix
caching on), in a pool small enough to preempt, for the n-gram proposer and for draft
models (the target itself: everything accepted; another model: almost everything rejected).
Prompts repeat themselves so that the n-gram proposer has something to propose. The adaptive
rule decides on measured step times, so only fixed-k configurations are held to speculating.
"""

from __future__ import annotations

import numpy as np
import pytest

from baselm.config import ConfigError, EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.tiny_model import loaded_fixture, loaded_widened_llama

KV_MEMORY = 2 * 2**20
GREEDY = SamplingParams(temperature=0, max_tokens=24)

PROPOSERS = {
    "ngram": (SpeculativeConfig("ngram", num_speculative_tokens=4), None),
    "ngram-fixed": (SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False), None),
    "draft-self": (SpeculativeConfig("draft", "llama", num_speculative_tokens=4, adaptive=False), "llama"),
    "draft-other": (SpeculativeConfig("draft", "qwen2", num_speculative_tokens=3, adaptive=False), "qwen2"),
}


def engine_for(proposer: str | None, **config) -> LLMEngine:
    config.setdefault("kv_memory", KV_MEMORY)
    if proposer is None:
        return LLMEngine(loaded_fixture(), EngineConfig(**config))
    spec, draft = PROPOSERS[proposer]
    return LLMEngine(
        loaded_fixture(), EngineConfig(speculative=spec, **config), loaded_fixture(draft) if draft else None
    )


def repeating_prompts(seed: int = 0, count: int = 16) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt): a random phrase repeated, some sharing a 40-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 40).tolist()
    out = []
    for i in range(count):
        phrase = rng.integers(0, 256, int(rng.integers(3, 12))).tolist()
        prompt = phrase * int(rng.integers(2, 6))
        if i % 3 == 0:
            prompt = shared + prompt
        out.append((int(rng.integers(0, 10)), prompt))
    return out


def run_staggered(engine: LLMEngine, requests, params=GREEDY) -> list[list[int]]:
    ids: list[str | None] = [None] * len(requests)
    generated: dict[str, list[int]] = {}
    step = 0
    while step <= max(a for a, _ in requests) or engine.has_unfinished:
        for i, (arrival, prompt) in enumerate(requests):
            if arrival == step:
                ids[i] = engine.add_request(prompt, params)
        for out in engine.step():
            generated.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
        assert step < 500
    return [generated[rid] for rid in ids]


def all_free(engine: LLMEngine) -> bool:
    free = engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    draft = engine.speculator.draft if engine.speculator is not None else None
    return free and (draft is None or draft.kv.num_free_blocks == draft.kv.num_blocks)


@pytest.fixture(scope="module")
def plain_batch() -> list[list[int]]:
    return run_staggered(engine_for(None), repeating_prompts())


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_greedy_alone_is_unchanged(proposer):
    prompt = repeating_prompts()[1][1]
    plain = engine_for(None).generate([prompt], GREEDY)[0].completions[0].token_ids
    engine = engine_for(proposer)
    assert engine.generate([prompt], GREEDY)[0].completions[0].token_ids == plain
    assert engine.spec_stats().num_draft_tokens > 0 or engine.config.speculative.adaptive
    assert all_free(engine)


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_greedy_batch_of_16_staggered_is_unchanged(proposer, plain_batch):
    engine = engine_for(proposer)
    assert run_staggered(engine, repeating_prompts()) == plain_batch
    stats = engine.spec_stats()
    assert stats.num_draft_tokens > 0 or engine.config.speculative.adaptive  # adaptive: as timing decides
    assert engine.kv_manager.prefix_cache_hits > 0
    if proposer == "draft-self":  # the target is its own draft: every draft is what it would pick
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert all_free(engine)


@pytest.mark.parametrize("proposer", ["ngram-fixed", "draft-other"])
def test_greedy_across_preemption_is_unchanged(proposer, plain_batch):
    engine = engine_for(proposer, kv_memory=10 * 16 * _bytes_per_token(), max_num_batched_tokens=512)
    assert engine.kv_manager.num_blocks == 10
    assert run_staggered(engine, repeating_prompts()) == plain_batch
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec_stats().num_draft_tokens > 0
    assert all_free(engine)


def _bytes_per_token() -> int:
    num_layers, num_kv_heads, head_dim = loaded_fixture().model.kv_shape()
    return 2 * num_layers * num_kv_heads * head_dim * 4


def test_drafts_share_the_step_budget(plain_batch):
    # 8 tokens a step: prompts go in chunks and drafts get what the chunks leave.
    engine = engine_for("ngram-fixed", max_num_batched_tokens=8, long_prefill_token_threshold=8)
    assert run_staggered(engine, repeating_prompts()) == plain_batch
    assert engine.spec_stats().num_draft_tokens > 0
    assert all_free(engine)


def test_a_request_can_opt_out():
    engine = engine_for("ngram-fixed")
    prompt = repeating_prompts()[1][1]
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, speculative=False))
    assert result[0].completions[0].num_draft_tokens == 0
    assert engine.spec_stats().num_draft_tokens == 0


def test_max_tokens_and_stop_ids_are_checked_token_by_token():
    prompt = repeating_prompts()[1][1]
    plain = engine_for(None).generate([prompt], GREEDY)[0].completions[0]
    stop_id = plain.token_ids[9]
    first = plain.token_ids.index(stop_id)
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        out = engine_for("draft-self").generate([prompt], params)[0].completions[0]
        assert out.token_ids == plain.token_ids[:max_tokens]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    out = engine_for("draft-self").generate([prompt], params)[0].completions[0]
    assert out.token_ids == plain.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_are_checked_over_the_accepted_run():
    prompt = repeating_prompts()[1][1]
    plain = engine_for(None).generate([prompt], GREEDY)[0].completions[0]
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    expected = engine_for(None).generate([prompt], params)[0].completions[0]
    out = engine_for("draft-self").generate([prompt], params)[0].completions[0]
    assert (out.text, out.token_ids, out.finish_reason) == (expected.text, expected.token_ids, "stop")


@pytest.mark.parametrize("proposer", ["ngram-fixed", "draft-other", "draft-self"])
def test_every_block_comes_back_after_a_mix_finishes_or_aborts(proposer):
    engine = engine_for(proposer)
    requests = repeating_prompts(seed=1, count=12)
    ids = []
    for i, (_, prompt) in enumerate(requests):
        params = SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=30, speculative=i % 4 != 3, n=2 if i == 5 else 1
        )
        ids.append(engine.add_request(prompt, params))
    for step in range(40):
        engine.step()
        if step in (3, 7, 11):
            engine.abort(ids[step // 2])
    while engine.has_unfinished:
        engine.step()
    assert engine.spec_stats().num_draft_tokens > 0
    assert all_free(engine)


def test_a_draft_model_with_another_vocabulary_is_refused():
    spec = SpeculativeConfig("draft", "widened", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="does not share the vocabulary"):
        LLMEngine(loaded_fixture(), EngineConfig(kv_memory=KV_MEMORY, speculative=spec), loaded_widened_llama("w"))


def test_speculative_config_is_validated():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="ngram_min"):
        SpeculativeConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError, match="draft model"):
        SpeculativeConfig("draft")
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("ngram", 5).num_speculative_tokens == 5
    assert SpeculativeConfig.parse("org/small").draft_model == "org/small"
