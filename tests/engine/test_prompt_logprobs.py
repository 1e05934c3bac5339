"""Prompt logprobs: every prompt token after the first, scored by the model, chunked or not, cached or not."""

from __future__ import annotations

import numpy as np

from baselm.sampling.params import SamplingParams
from tests.engine.test_batch_equivalence import engine_bytes_per_token
from tests.forward import prefill_logits

PROMPT = list(range(10, 60))  # 50 tokens


def expected_logprobs(engine, prompt: list[int]) -> np.ndarray:
    """(len(prompt) - 1, vocab): log_softmax of the full-prompt forward at positions 0 .. n-2."""
    logits = prefill_logits(engine.loaded.model, prompt).astype(np.float64)[:-1]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def check(entries, expected: np.ndarray, prompt: list[int], num_top: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for i, entry in enumerate(entries):
        assert abs(entry.logprob - expected[i, prompt[i + 1]]) < 1e-4
        assert [t for t, _ in entry.top] == list(np.argsort(-expected[i])[:num_top])
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_prompt_logprobs_match_one_forward_over_the_prompt_in_any_chunking(make_engine):
    for budget in (1024, 16, 7):  # whole, and chunked across steps at block and odd boundaries
        engine = make_engine(max_num_batched_tokens=budget, long_prefill_token_threshold=0)
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
        [completion] = engine.generate([PROMPT], params)[0].completions
        check(completion.prompt_logprobs, expected_logprobs(engine, PROMPT), PROMPT, 3)
        assert len(completion.token_ids) == 2


def test_a_cached_prompt_is_scored_whole_and_plain_requests_still_hit_the_cache(make_engine):
    engine = make_engine()
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    again = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    check(again.completions[0].prompt_logprobs, expected_logprobs(engine, PROMPT), PROMPT, 0)
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.num_cached_tokens > 0


def test_requests_batched_together_get_their_own_prompts_scored_and_copies_none(make_engine):
    engine = make_engine(max_num_batched_tokens=24)
    prompts = [PROMPT, [5, 17, 99, 3], [200] * 33]
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, n=2),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0),
    ]
    results = engine.generate(prompts, params)
    check(results[0].completions[0].prompt_logprobs, expected_logprobs(engine, PROMPT), PROMPT, 1)
    assert results[0].completions[1].prompt_logprobs == []  # copies share the first's prompt
    assert results[1].completions[0].prompt_logprobs == []
    check(results[2].completions[0].prompt_logprobs, expected_logprobs(engine, prompts[2]), prompts[2], 0)


def test_a_preempted_request_reports_each_prompt_token_once(make_engine):
    # 7 blocks of 16 tokens cannot hold both requests' contexts (5 blocks each): one is preempted and recomputed.
    engine = make_engine(kv_memory=7 * 16 * engine_bytes_per_token(), max_num_batched_tokens=32)
    assert engine.kv_manager.num_blocks == 7
    prompts = [PROMPT, list(range(100, 150))]
    params = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        check(result.completions[0].prompt_logprobs, expected_logprobs(engine, prompt), prompt, 0)
