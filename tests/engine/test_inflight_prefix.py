"""Requests that arrive together with a shared prefix compute it once: the later ones wait for the
blocks another request is computing, then start from them; nothing else waits, no answer changes."""

from __future__ import annotations

from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.engine.fake_model import greedy, make, plan, request, run_to_end, step
from tests.tiny_model import loaded_widened_llama

PREFIX = list(range(100, 112))  # three full blocks of 4


def test_a_request_waits_for_the_prefix_another_is_computing_then_hits_it():
    scheduler, model = make(budget=64)
    scheduler.add_request(request("a", PREFIX + [1, 2], max_tokens=3))
    scheduler.add_request(request("b", PREFIX + [3, 4, 5], max_tokens=3, seed=1))
    first, _ = step(scheduler, model)
    assert plan(first) == [("a", 0, 14, True)]  # b did not compute the prefix a is computing
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    second, outputs = step(scheduler, model)
    assert plan(second) == [("a", 14, 1, True), ("b", 12, 3, True)]  # b starts from a's cached blocks
    assert {o.request_id: o.num_cached_tokens for o in outputs}["b"] == 12
    tokens = run_to_end(scheduler, model)
    assert [t for o in outputs if o.request_id == "b" for t in o.token_ids] + tokens["b"] == greedy(
        PREFIX + [3, 4, 5], 1, 3
    )
    assert scheduler.stats().num_used_blocks == 0


def test_requests_behind_a_waiting_one_are_still_admitted():
    scheduler, model = make(budget=64)
    scheduler.add_request(request("a", PREFIX + [1], max_tokens=2))
    scheduler.add_request(request("b", PREFIX + [2], max_tokens=2))
    scheduler.add_request(request("c", [7, 8, 9], max_tokens=2))  # shares nothing: never held back
    first, _ = step(scheduler, model)
    assert [p[0] for p in plan(first)] == ["a", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_a_long_shared_prompt_chunked_over_steps_is_still_computed_once():
    scheduler, model = make(budget=8, num_blocks=32)
    scheduler.add_request(request("a", PREFIX + [1, 2], max_tokens=2))
    scheduler.add_request(request("b", PREFIX + [3], max_tokens=2))
    plans = [plan(step(scheduler, model)[0]) for _ in range(3)]
    assert plans[0] == [("a", 0, 8, False)]
    assert plans[1] == [("a", 8, 6, True)]  # b still waits: a computes block 3 of the prefix now
    assert plans[2] == [("a", 14, 1, True), ("b", 12, 1, True)]
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 12


def test_when_the_owner_is_aborted_the_waiting_request_computes_the_prefix_itself():
    scheduler, model = make(budget=8, num_blocks=32)
    scheduler.add_request(request("a", PREFIX + [1, 2], max_tokens=2))
    scheduler.add_request(request("b", PREFIX + [3], max_tokens=2, seed=2))
    step(scheduler, model)  # a computed blocks 0 and 1 (cached); b waits for block 2
    scheduler.abort(["a"])
    output, _ = step(scheduler, model)
    assert plan(output) == [("b", 8, 5, True)]
    tokens = run_to_end(scheduler, model)
    assert len(tokens["b"]) == 1 and scheduler.stats().num_used_blocks == 0


def test_with_sharing_or_prefix_caching_off_both_compute_the_prefix():
    for options in ({"prefix_caching": False}, {}):
        scheduler, model = make(budget=64, **options)
        scheduler.share_inflight_prefixes = not options == {}
        scheduler.add_request(request("a", PREFIX + [1], max_tokens=2))
        scheduler.add_request(request("b", PREFIX + [2], max_tokens=2))
        assert [p[:3] for p in plan(step(scheduler, model)[0])] == [("a", 0, 13), ("b", 0, 13)]


def test_a_wave_with_shared_prefixes_gives_the_same_greedy_answers_and_computes_less():
    loaded = loaded_widened_llama("tiny")
    prefix = [(7 * i) % 200 + 3 for i in range(40)]
    prompts = [prefix + [(13 * j + k) % 200 + 3 for k in range(5 + j)] for j in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    answers, computed = [], []
    for share in (True, False):
        engine = LLMEngine(loaded, EngineConfig(kv_memory=4 * 2**20))
        engine.scheduler.share_inflight_prefixes = share
        results = engine.generate(prompts, params)
        answers.append([r.completions[0].token_ids for r in results])
        stats = engine.stats()
        computed.append(stats.prefix_cache_queries - stats.prefix_cache_hits)
        assert stats.num_used_blocks == 0
    assert answers[0] == answers[1]
    suffixes = sum(len(p) - len(prefix) for p in prompts)
    assert computed[0] <= len(prefix) + suffixes + 8 * 16  # each request recomputes at most its last partial block
    assert computed[1] > computed[0]
