"""One rank of a prefill/decode test group: `python -m tests.distributed.pd_rank SPEC_JSON` with MLX_RANK and
MLX_HOSTFILE set. Rank 0 runs the spec's workload through a PDEngine and prints one JSON line of
results; the other ranks serve until rank 0 stops them.

The spec: {"layout": "1:1", "model": "fixture" | "widened" | path, "config": {EngineConfig fields},
"requests": [[arrival step, prompt ids, max_tokens, {SamplingParams fields, "schema": a JSON
Schema the answer follows} (optional; greedy without)], ...], "abort": {index: step},
"kill_rank": [rank, step] (rank 0 kills that rank's process at that step), "save_steps": [step, ...]
(rank 0 asks for the prefix cache files to be saved then), "pids": {rank: pid}}. With a prefix cache file,
the result lists the files in its folder before the group stops ("files_before_stop").
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import mlx.core as mx

import baselm  # noqa: F401  the optimized BLAS first
from baselm.config import EngineConfig, SpeculativeConfig
from baselm.distributed.group import RankFailedError
from baselm.distributed.pd.engine import PDEngine
from baselm.distributed.pd.launch import make_node, share_cores
from baselm.distributed.pd.node import Layout, serve
from baselm.distributed.watchdog import Watchdog
from baselm.sampling.params import Constraint, SamplingParams


def load(spec: dict):
    if spec["model"] == "fixture":
        from tests.tiny_model import loaded_fixture

        return loaded_fixture("llama")
    if spec["model"] == "widened":  # a tokenizer-sized vocabulary and end-of-sequence ids, for grammars
        from tests.tiny_model import loaded_widened_llama

        return loaded_widened_llama("tiny")
    from baselm.backend import select_backend
    from baselm.loader import load_model

    return load_model(spec["model"], select_backend("cpu"))


def make_config(spec: dict) -> EngineConfig:
    fields = dict(spec.get("config", {}))
    speculative = fields.pop("speculative", None)
    config = EngineConfig(**fields)
    if speculative:
        config.speculative = SpeculativeConfig.parse(speculative, 4, adaptive=False)
    return config


def make_params(engine, max_tokens: int, fields: dict | None) -> SamplingParams:
    """A request's params: greedy, or `fields`; a "schema" becomes the constraint the API would make."""
    fields = {"temperature": 0.0, **(fields or {})}
    schema = fields.pop("schema", None)
    if schema is None:
        return SamplingParams(max_tokens=max_tokens, **fields)
    from baselm.structured.grammar import json_schema_grammar
    from baselm.toolcalls.forcing import processor_factory

    eos = list(engine.eos_token_ids)
    constraint = Constraint(json_schema_grammar(schema), eos)
    make = processor_factory(engine.tokenizer, engine.vocab_size)
    return SamplingParams(
        max_tokens=max_tokens,
        constraint=constraint,
        make_logits_processors=lambda: make(constraint),
        stop_token_ids=eos,
        **fields,
    )


def run_workload(engine: PDEngine, spec: dict) -> dict:
    """Feeds requests at their arrival steps; aborts and kills on schedule; returns each copy's
    tokens ("r3" is copy 0 of request 3, "r3/1" copy 1), logprobs and prompt logprobs (as
    [token id, logprob]), finish reasons, errors."""
    requests = spec["requests"]
    aborts = {int(i): step for i, step in spec.get("abort", {}).items()}
    kill = spec.get("kill_rank")
    result = {"tokens": {}, "logprobs": {}, "prompt_logprobs": {}, "reasons": {}, "errors": []}
    step = 0
    while step <= max(r[0] for r in requests) or engine.has_unfinished:
        for i, (arrival, prompt, max_tokens, *fields) in enumerate(requests):
            if arrival == step:
                engine.add_request(prompt, make_params(engine, max_tokens, fields[0] if fields else None), f"r{i}")
            if aborts.get(i) == step:
                engine.abort(f"r{i}")
        if step in spec.get("save_steps", ()):
            engine.save_prefix_cache()
        if kill is not None and kill[1] == step:  # [rank, step, signal name]: SIGKILL dies, SIGSTOP hangs
            os.kill(spec["pids"][str(kill[0])], getattr(signal, kill[2] if len(kill) > 2 else "SIGKILL"))
        try:
            outputs = engine.step()
        except RankFailedError as exc:
            result["errors"].append(str(exc))
            outputs = []
        for out in outputs:
            record(result, out)
        step += 1
    return {**result, "steps": step}


def record(result: dict, out) -> None:
    key = out.request_id if out.index == 0 else f"{out.request_id}/{out.index}"
    result["tokens"].setdefault(key, []).extend(out.token_ids)
    result["logprobs"].setdefault(key, []).extend([e.token_id, e.logprob] for e in out.logprobs)
    if out.prompt_logprobs:
        result["prompt_logprobs"].setdefault(key, []).extend([e.token_id, e.logprob] for e in out.prompt_logprobs)
    if out.finished:
        result["reasons"][key] = out.finish_reason


def main() -> None:
    spec = json.loads(sys.argv[1])
    layout = Layout.parse(spec["layout"])
    group = mx.distributed.init(backend="ring", strict=True)
    share_cores(layout.size)
    loaded = load(spec)
    node = make_node(loaded, make_config(spec), layout, group)
    if group.rank() != 0:
        try:
            serve(node)
        except RankFailedError:
            sys.exit(1)
        return
    watchdog = None
    if "step_timeout" in spec:  # ends every other rank when a step hangs, as `base serve --pd` does
        pids = [int(p) for p in spec["pids"].values()]
        watchdog = Watchdog(spec["step_timeout"], on_expire=lambda what, s: [os.kill(p, signal.SIGKILL) for p in pids])
    engine = PDEngine(node, loaded, make_config(spec), watchdog=watchdog)
    result = run_workload(engine, spec)
    if engine.fallback is None:
        result["stats"] = [vars_of(s) for s in engine.sync()]
        result["stats"] = [vars_of(s) for s in engine.sync()]
        if engine.config.prefix_cache_file:
            result["files_before_stop"] = sorted(p.name for p in Path(engine.config.prefix_cache_file).parent.iterdir())
        engine.stop()
    else:
        stats = engine.fallback.stats()
        result["fallback_free_blocks"] = [stats.num_free_blocks, engine.fallback.kv_manager.num_blocks]
        result["fallback_prefix_cache_hits"] = stats.prefix_cache_hits
    print("RESULT " + json.dumps(result), flush=True)


def vars_of(stats) -> dict:
    return {name: getattr(stats, name) for name in stats.__slots__}


if __name__ == "__main__":
    main()
