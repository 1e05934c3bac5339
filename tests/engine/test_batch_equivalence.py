"""Batching never changes what a request computes.

Teacher forcing: every request's continuation is fixed in advance by a logits processor,
which also records the model's logits at each sampling step. The logits of each request
in a batch of 16 (mixed lengths, staggered arrivals, shared prefixes) must equal its
logits run alone within 1e-4, whatever the chunk size, with prefix caching on or off,
and in a pool so small that requests get preempted and recomputed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.tiny_model import loaded_fixture

TOL = 1e-4
VOCAB = 256


class TeacherForcing:
    """Logits processor: records the model's logits, then forces the next scripted token."""

    def __init__(self, forced: list[int]):
        self.forced = forced
        self.logits: dict[int, np.ndarray] = {}  # output position -> (vocab,) logits

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        position = len(output_ids)
        self.logits[position] = np.array(logits)
        return mx.where(mx.arange(logits.shape[0]) == self.forced[position], 0.0, -1e9)


def workload(seed: int = 0) -> list[tuple[int, list[int], list[int]]]:
    """16 requests: (arrival step, prompt ids, forced continuation); some share a 40-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 40).tolist()
    requests = []
    for i in range(16):
        length = int(rng.integers(1, 90))
        prompt = rng.integers(0, VOCAB, length).tolist()
        if i % 3 == 0:
            prompt = shared + prompt[:20]
        forced = rng.integers(0, VOCAB, int(rng.integers(3, 14))).tolist()
        requests.append((int(rng.integers(0, 12)), prompt, forced))
    return requests


def run(engine, requests) -> tuple[list[TeacherForcing], list[list[int]]]:
    """Feeds requests at their arrival steps; returns the recorders and the generated ids."""
    recorders = [TeacherForcing(forced) for _, _, forced in requests]
    generated: dict[str, list[int]] = {}
    ids = [None] * len(requests)
    step = 0
    while step < 200 and (step <= max(a for a, _, _ in requests) or engine.has_unfinished):
        for i, (arrival, prompt, forced) in enumerate(requests):
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=len(forced), logits_processors=[recorders[i]])
                ids[i] = engine.add_request(prompt, params)
        for out in engine.step():
            generated.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    assert not engine.has_unfinished
    return recorders, [generated[rid] for rid in ids]


@pytest.fixture(scope="module")
def alone_logits():
    results = []
    for _, prompt, forced in workload():
        engine = LLMEngine(loaded_fixture(), EngineConfig(kv_memory=2 * 2**20, enable_prefix_caching=False))
        recorders, _ = run(engine, [(0, prompt, forced)])
        results.append(recorders[0].logits)
    return results


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk", [16, 64, None])
def test_batched_logits_equal_alone(make_engine, alone_logits, prefix_caching, chunk):
    engine = make_engine(
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=chunk or 4096,
        long_prefill_token_threshold=chunk or 0,
    )
    requests = workload()
    recorders, generated = run(engine, requests)
    for (_, _, forced), recorder, alone, out in zip(requests, recorders, alone_logits, generated):
        assert out == forced
        assert sorted(recorder.logits) == sorted(alone)
        for position, logits in alone.items():
            np.testing.assert_allclose(recorder.logits[position], logits, atol=TOL, rtol=0)
    if prefix_caching:
        assert engine.kv_manager.prefix_cache_hits > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_preemption_keeps_logits(make_engine, alone_logits):
    # 12 blocks of 16 tokens: far fewer than 16 requests of up to ~100 tokens need at once.
    engine = make_engine(kv_memory=12 * 16 * engine_bytes_per_token(), max_num_batched_tokens=512)
    assert engine.kv_manager.num_blocks == 12
    requests = workload()
    recorders, generated = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for (_, _, forced), recorder, alone, out in zip(requests, recorders, alone_logits, generated):
        assert out == forced
        for position, logits in alone.items():
            np.testing.assert_allclose(recorder.logits[position], logits, atol=TOL, rtol=0)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def engine_bytes_per_token() -> int:
    num_layers, num_kv_heads, head_dim = loaded_fixture().model.kv_shape()
    return 2 * num_layers * num_kv_heads * head_dim * 4


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "smollm3"])
def test_sinks_windows_and_nope_layers_keep_batched_logits_equal_alone(make_engine, name):
    # gpt-oss (sinks, a sliding layer, MXFP4 routed experts) and SmolLM3 (a layer without RoPE),
    # chunked in steps of 16 tokens beside each other, with prefix caching.
    requests = workload()[:8]
    alone = []
    for _, prompt, forced in requests:
        recorders, _ = run(make_engine(name, enable_prefix_caching=False), [(0, prompt, forced)])
        alone.append(recorders[0].logits)
    engine = make_engine(name, max_num_batched_tokens=16, long_prefill_token_threshold=16)
    recorders, generated = run(engine, requests)
    assert engine.kv_manager.prefix_cache_hits > 0
    for (_, _, forced), recorder, logits_alone, out in zip(requests, recorders, alone, generated):
        assert out == forced and sorted(recorder.logits) == sorted(logits_alone)
        for position, logits in logits_alone.items():
            np.testing.assert_allclose(recorder.logits[position], logits, atol=TOL, rtol=0)
