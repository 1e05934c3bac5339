"""Requests with LoRA adapters batched beside plain ones: each request gets what it gets alone.

Teacher forcing as in test_batch_equivalence.py: a logits processor records each request's logits at
every step and forces its scripted continuation, so every engine runs the same steps. Requests with
two different adapters and plain ones arrive staggered, share prefixes, and go through chunked
prefill, preemption and speculative decoding; each one's logits equal its logits alone (1e-4), and a
plain request's equal, bit for bit, what it computes in the same batch on an engine with no adapters.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import Backend, select_backend
from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel, load_model
from baselm.models import cpu_layer
from baselm.sampling.params import SamplingParams
from baselm.served_adapters import AdapterSpec
from tests.engine.test_batch_equivalence import TeacherForcing
from tests.lora_files import PEFT, llama_folder, peft_adapter

TOL = 1e-4
KV_MEMORY = 2 * 2**20
NO_KERNELS = Backend("cpu", mx.float32, keep_quantized=False, cpu_kernels=False)  # MLX's ops: one path every step


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("batches") / "llama")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return peft_adapter(tmp_path_factory.mktemp("other") / "other", ("k_proj", "o_proj", "gate_proj", "up_proj"), 1)


def served(folder, other, backend=None) -> LoadedModel:
    """The tiny llama serving adapter "a" (the PEFT fixture) and "b" (`other`)."""
    specs = [AdapterSpec.read(f"a={PEFT}"), AdapterSpec.read(f"b={other}")]
    return load_model(str(folder), backend or select_backend("cpu"), served_adapters=specs)


def workload(seed: int = 0) -> list[tuple[int, list[int], list[int], str | None]]:
    """12 requests: (arrival step, prompt, forced continuation, adapter name or None); plain requests
    and both adapters' requests share one 40-token prefix in turn."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 40).tolist()
    requests = []
    for i in range(12):
        prompt = rng.integers(0, 256, int(rng.integers(1, 60))).tolist()
        if i % 2 == 0:
            prompt = shared + prompt[:20]
        forced = rng.integers(0, 256, int(rng.integers(3, 10))).tolist()
        requests.append((int(rng.integers(0, 8)), prompt, forced, (None, "a", "b")[i % 3]))
    return requests


def run(engine: LLMEngine, requests, adapters: bool = True) -> list[TeacherForcing]:
    """Feeds `requests` at their arrival steps, each with its adapter (all plain when not `adapters`)."""
    served = engine.loaded.served_adapters
    recorders = [TeacherForcing(forced) for _, _, forced, _ in requests]
    step = 0
    while step <= max(r[0] for r in requests) or engine.has_unfinished:
        for recorder, (arrival, prompt, forced, name) in zip(recorders, requests):
            if arrival == step:
                params = SamplingParams(temperature=0, max_tokens=len(forced), logits_processors=[recorder])
                choice = served.named(name) if adapters and name is not None else None
                engine.add_request(prompt, params, adapters=choice)
        engine.step()
        step += 1
        assert step < 500
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return recorders


@pytest.fixture(scope="module")
def alone(folder, other) -> list[dict[int, np.ndarray]]:
    """Each request's logits run alone, with its adapter, on the kernels' backend."""
    loaded = served(folder, other)
    logits = []
    for _, prompt, forced, name in workload():
        engine = LLMEngine(loaded, EngineConfig(kv_memory=KV_MEMORY, enable_prefix_caching=False))
        logits.append(run(engine, [(0, prompt, forced, name)])[0].logits)
    return logits


def assert_as_alone(recorders: list[TeacherForcing], alone: list[dict[int, np.ndarray]]) -> None:
    for recorder, expected in zip(recorders, alone, strict=True):
        assert sorted(recorder.logits) == sorted(expected)
        for position, logits in expected.items():
            np.testing.assert_allclose(recorder.logits[position], logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [16, None])
def test_plain_requests_and_two_adapters_in_one_batch_each_get_their_own_logits(folder, other, alone, chunk):
    config = EngineConfig(
        kv_memory=KV_MEMORY, max_num_batched_tokens=chunk or 4096, long_prefill_token_threshold=chunk or 0
    )
    engine = LLMEngine(served(folder, other), config)
    assert_as_alone(run(engine, workload()), alone)
    assert engine.kv_manager.prefix_cache_hits > 0  # each adapter's shared prefix, and the plain one


def test_adapter_requests_keep_their_logits_across_preemption(folder, other, alone):
    loaded = served(folder, other)
    num_layers, num_kv_heads, head_dim = loaded.model.kv_shape()
    block_bytes = 2 * num_layers * num_kv_heads * head_dim * 4 * 16  # K and V, float32, 16 tokens
    engine = LLMEngine(loaded, EngineConfig(kv_memory=8 * block_bytes, max_num_batched_tokens=512))
    assert engine.kv_manager.num_blocks == 8
    assert_as_alone(run(engine, workload()), alone)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("model", ["float, MLX ops", "float, CPU kernels", "q8, CPU kernels"])
def test_a_plain_request_beside_adapters_computes_bit_for_bit_what_it_computes_without_them(
    folder, other, model, tmp_path
):
    """The plain rows of a step are the linear layers' own outputs, the adapters' deltas going to other
    rows only. With the CPU kernels, a step with adapter rows takes the per-op path where the same step
    all plain takes the one-node layer, whose loops are the per-op kernels': the same bits too. No prefix
    caching, so that both engines run the same steps (all plain, the adapters' requests would hit the
    plain prefix)."""
    from baselm.store.import_local import import_local
    from baselm.store.registry import Store

    backend = NO_KERNELS if "MLX" in model else select_backend("cpu")
    path = folder
    if model.startswith("q8"):
        path = import_local(folder, quant="q8", supported={"llama"}, store=Store(tmp_path)).path
    requests = workload()
    config = EngineConfig(kv_memory=KV_MEMORY, enable_prefix_caching=False)
    with_adapters = run(LLMEngine(served(path, other, backend), config), requests)
    all_plain = run(LLMEngine(load_model(str(path), backend), config), requests, adapters=False)  # the same steps
    for (_, _, _, name), got, expected in zip(requests, with_adapters, all_plain):
        if name is None:
            assert sorted(got.logits) == sorted(expected.logits)
            for position, logits in expected.logits.items():
                np.testing.assert_array_equal(got.logits[position], logits)
        else:
            assert max(np.abs(got.logits[p] - expected.logits[p]).max() for p in expected.logits) > 0.1


def test_steps_without_adapter_rows_keep_the_one_node_cpu_layer(folder, other, monkeypatch):
    """Plain requests on a model that serves adapters: the same one-node layer calls, bit for bit the same
    logits as with no adapters loaded; a step with adapter rows goes to the per-op path."""
    from baselm import cpu

    if cpu.kernels is None:
        pytest.skip("the CPU kernels are not built here")
    calls = []
    real = cpu_layer.decoder_layer
    monkeypatch.setattr(cpu_layer, "decoder_layer", lambda *a: calls.append(out := real(*a)) or out)
    plain_only = [r[:3] + (None,) for r in workload()]
    got = run(LLMEngine(served(folder, other), EngineConfig(kv_memory=KV_MEMORY)), plain_only)
    fused_calls = sum(out is not None for out in calls)
    no_adapters = load_model(str(folder), select_backend("cpu"))
    expected = run(LLMEngine(no_adapters, EngineConfig(kv_memory=KV_MEMORY)), plain_only)
    assert sum(out is not None for out in calls) == 2 * fused_calls > 0  # as many one-node calls each
    for g, e in zip(got, expected):
        for position, logits in e.logits.items():
            np.testing.assert_array_equal(g.logits[position], logits)
    calls.clear()
    run(LLMEngine(served(folder, other), EngineConfig(kv_memory=KV_MEMORY)), [(0, list(range(5)), [1, 2], "a")])
    assert calls and all(out is None for out in calls)


SPECULATIVE = {
    "ngram": (SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False), False),
    "draft": (SpeculativeConfig("draft", "llama", num_speculative_tokens=3, adaptive=False), True),
}


@pytest.mark.parametrize("method", list(SPECULATIVE))
def test_speculative_decoding_keeps_an_adapter_requests_greedy_answer(folder, other, method):
    """Drafts (n-gram lookups, or the plain model as the draft) are verified by the adapted target with the
    exact rule: an adapter request's greedy answer is the one it gets without speculation."""
    loaded = served(folder, other)
    choice = loaded.served_adapters.named("b")
    phrase = np.random.default_rng(3).integers(0, 256, 6).tolist()
    prompts = [phrase * 4, phrase[::-1] * 3]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain_engine = LLMEngine(loaded, EngineConfig(kv_memory=KV_MEMORY))
    expected = [r.completions[0].token_ids for r in plain_engine.generate(prompts, greedy, [choice, None])]
    spec, has_draft = SPECULATIVE[method]
    draft = load_model(str(folder), select_backend("cpu")) if has_draft else None
    engine = LLMEngine(loaded, EngineConfig(kv_memory=KV_MEMORY, speculative=spec), draft)
    got = [r.completions[0].token_ids for r in engine.generate(prompts, greedy, [choice, None])]
    assert got == expected
    assert engine.spec_stats().num_draft_tokens > 0
