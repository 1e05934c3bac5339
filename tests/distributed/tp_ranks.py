"""Entry point of both ranks in the tensor-parallel tests: `python -m tests.distributed.tp_ranks TEST`.

Rank 0 starts rank 1, both build each fixture sharded over the pair, and rank 0 prints one JSON
line comparing what the pair computed with the whole model in rank 0 alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai

import baselm  # noqa: F401  first: the BLAS before mlx.core
from baselm import cpu
from baselm import distributed as dist
from baselm.backend import select_backend
from baselm.config import EngineConfig, SpeculativeConfig
from baselm.distributed.tp.engine import follow
from baselm.distributed.tp.launch import DistOptions, describe, lead, load
from baselm.distributed.tp.layers import DEFAULT_MOE_SPLIT, Sharding
from baselm.distributed.tp.moe import MOE_SPLITS
from baselm.embedding import embed
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.models import build_model
from baselm.sampling.params import SamplingParams
from baselm.store import hf
from baselm.tokenizer.tokenizer import Tokenizer
from tests.distributed.moe_fixtures import WIDENED_EXPERTS, widened_experts
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES

FIXTURES = sorted(p.name for p in MODEL_FIXTURES.iterdir() if (p / "config.json").exists())
PROMPT = [3, 17, 42, 99, 5, 200, 11, 64, 7, 128, 31]


def quantized(weights: dict[str, mx.array], group_size: int = 32, bits: int = 4) -> dict[str, mx.array]:
    """The fixture's projection weights (experts' too) as affine triplets (the layout `.base` and GGUF files load)."""
    out = {}
    for name, value in weights.items():
        is_projection = name.endswith("_proj.weight") or (".experts." in name and name.endswith(".weight"))
        if is_projection and value.ndim == 2 and value.shape[-1] % group_size == 0:
            prefix = name.removesuffix(".weight")
            codes, scales, biases = mx.quantize(value, group_size, bits)
            out |= {f"{prefix}.weight": codes, f"{prefix}.scales": scales, f"{prefix}.biases": biases}
        else:
            out[name] = value
    return out


def _build(name: str, sharding: Sharding | None, quant: str | None):
    """A fixture, whole or sharded: float, or quantized through the CPU kernels ("kernels") or
    MLX's quantized layers ("reference")."""
    folder = MODEL_FIXTURES / name
    weights = hf.read_weights(folder)
    if quant:
        weights = quantized(weights)
    kernels = quant == "kernels" and cpu.available()
    return build_model(hf.read_config(folder), weights, keep_quantized=bool(quant), cpu_kernels=kernels, shard=sharding)


def logits(group: dist.DistGroup, quant: str | None) -> dict:
    """Prefill logits of every fixture: the pair against rank 0's whole model."""
    result = {}
    names = FIXTURES if not quant else ["llama", "qwen2", "mistral", "phi3", "smollm3"]
    for name in names:
        sharding = Sharding(group.rank, group.size, group.group)
        pair = prefill_logits(_build(name, sharding, quant), PROMPT)
        if group.rank == 0:
            whole = prefill_logits(_build(name, None, quant), PROMPT)
            result[name] = {
                "max_abs_diff": float(np.abs(pair - whole).max()),
                "same_argmax": bool((pair.argmax(-1) == whole.argmax(-1)).all()),
                "sharding": sharding.describe(),
            }
    return result


# Prompts that repeat themselves, so n-gram speculation finds drafts; several at once (batching).
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 9, 10, 11], list(range(20, 57)), [100, 101] * 6]
ENGINE_CONFIGS = {
    "plain": {},
    "kv8": {"kv_bits": 8},
    "ngram": {"speculative": SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False)},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 2},
}


def _loaded(name: str, model) -> LoadedModel:
    config = hf.read_config(MODEL_FIXTURES / name)
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    return LoadedModel(name, MODEL_FIXTURES / name, model, tokenizer, config, (), select_backend("cpu"))


def _generate(loaded: LoadedModel, config: dict) -> dict:
    """Greedy answers to PROMPTS, run together, how many drafts the engine verified, and the
    prompts' mean-pooled embeddings (the hidden-state path)."""
    engine = LLMEngine(loaded, EngineConfig(max_model_len=128, kv_memory=2**20, block_size=8, **config))
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    ids = [r.completions[0].token_ids for r in results]
    vectors = embed(engine, PROMPTS, "mean", normalize=False)
    return {
        "token_ids": ids,
        "num_draft_tokens": engine.spec_stats().num_draft_tokens,
        "embeddings": [v.tolist() for v in vectors],
    }


def engine(group: dist.DistGroup, names: list[str], configs: list[str], moe_split: str = DEFAULT_MOE_SPLIT) -> dict:
    """Greedy answers of the engine over the pair against the engine on rank 0's whole model."""
    result = {}
    for name in names:
        for config in configs:
            model = _build(name, Sharding(group.rank, group.size, group.group, moe_split=moe_split), None)
            if group.rank != 0:
                follow(model, group.group)
                continue
            loaded = lead(_loaded(name, model), group)
            pair = _generate(loaded, ENGINE_CONFIGS[config])
            loaded.model.stop()
            whole = _generate(_loaded(name, _build(name, None, None)), ENGINE_CONFIGS[config])
            result[f"{name}/{config}"] = {"pair": pair, "whole": whole}
    return result


MOE_FIXTURES = ["gpt_oss", "mixtral", "qwen3_moe", "qwen3_moe_sparse"]


def _moe_weights(name: str, bits: int | None) -> tuple[dict, dict]:
    """(config, weights) of an MoE fixture: float, or with projections and experts quantized to
    `bits` in groups of 32 (experts widened to split on groups both ways)."""
    if bits is None:
        return hf.read_config(MODEL_FIXTURES / name), hf.read_weights(MODEL_FIXTURES / name)
    config, weights = widened_experts(MODEL_FIXTURES / name, WIDENED_EXPERTS[name])
    return config, quantized(weights, bits=bits)


def moe_logits(group: dist.DistGroup) -> dict:
    """Prefill logits of the MoE fixtures split each way, in float32 and with q4 and q8 weights
    kept quantized: the pair against rank 0's whole model."""
    result = {}
    for split in MOE_SPLITS:
        for name in MOE_FIXTURES:
            for bits in (None, 4, 8):
                if bits is not None and name not in WIDENED_EXPERTS:
                    continue
                config, weights = _moe_weights(name, bits)
                sharding = Sharding(group.rank, group.size, group.group, moe_split=split)
                pair = prefill_logits(build_model(config, dict(weights), keep_quantized=True, shard=sharding), PROMPT)
                if group.rank == 0:
                    whole = prefill_logits(build_model(config, weights, keep_quantized=True), PROMPT)
                    result[f"{split}/{name}/{bits or 32}"] = {
                        "max_abs_diff": float(np.abs(pair - whole).max()),
                        "same_argmax": bool((pair.argmax(-1) == whole.argmax(-1)).all()),
                        "sharding": sharding.describe(),
                    }
    return result


TESTS = {
    "engine": lambda g: engine(g, FIXTURES, ["plain"]),
    "engine_options": lambda g: engine(g, ["llama"], ["kv8", "ngram", "chunked"]),
    "logits": lambda g: logits(g, None),
    "moe_logits": moe_logits,
    "moe_engine": lambda g: {s: engine(g, MOE_FIXTURES, ["plain", "kv8"], s) for s in MOE_SPLITS},
    "quantized_logits": lambda g: {q: logits(g, q) for q in ("kernels", "reference")},
}


def rank_dies(folder: str) -> dict:
    """A server on a 2-rank model (rank 1 started as `base` starts it); rank 1 is killed while a
    stream runs. Returns what the clients saw."""
    from tests.api.conftest import RunningServer

    loaded, _ = load(folder, "cpu", False, DistOptions(tensor_parallel=2))
    server = RunningServer(loaded=loaded, model_name="tiny")
    client = server.openai()
    messages = [{"role": "user", "content": "Hello!"}]
    seen: dict = {
        # ignore_eos: the request samples at the model's defaults, and a sampled end token would stop it early.
        "before": client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .finish_reason
    }
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    worker = loaded.model.dist_group.children[0]
    worker.kill()
    worker.wait()
    try:
        seen["stream_chunks_after_kill"] = sum(1 for _ in stream)
    except openai.APIError as e:
        seen["stream_error"] = str(e)
    for key in ("after", "again"):
        response = server.http().post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        seen[key] = {"status": response.status_code, "message": response.json()["error"]["message"]}
    server.stop()
    return seen


def smollm2(gguf: str, reference: str) -> dict:
    """SmolLM2-135M (Q4_1) split over 2 ranks as `base run --tensor-parallel 2` splits it: the
    reference's 8 prompts batched, greedy, 32 tokens."""
    loaded, _ = load(gguf, "cpu", False, DistOptions(tensor_parallel=2))
    cases = json.loads(Path(reference).read_text())["cases"]
    engine = LLMEngine(loaded, EngineConfig(kv_memory=64 * 2**20))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    results = engine.generate([c["prompt_token_ids"] for c in cases], params)
    seen = []
    for case, result in zip(cases, results):
        out = result.completions[0]
        first = [[t, lp] for t, lp in out.logprobs[0].top]
        seen.append({"expected": case["generated_token_ids"], "token_ids": out.token_ids, "first_top5": first})
    return {"cases": seen, "sharding": describe(loaded)}


def main() -> None:
    name = sys.argv[1]
    if name in ("rank_dies", "smollm2"):
        print(json.dumps((rank_dies if name == "rank_dies" else smollm2)(*sys.argv[2:])), flush=True)
        return
    group = dist.form([sys.executable, "-m", "tests.distributed.tp_ranks", name], 2)
    result = TESTS[name](group)
    if group.rank == 0:
        print(json.dumps(result), flush=True)
        group.stop()


if __name__ == "__main__":
    main()
