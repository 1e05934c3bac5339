"""One rank of a prefill/decode test group: `python -m tests.dist.pd_rank SPEC_JSON` with MLX_RANK and
MLX_HOSTFILE set. Rank 0 runs the spec's workload through a PDEngine and prints one JSON line of
results; the other ranks serve until rank 0 stops them.

The spec: {"layout": "1:1", "model": "fixture" | path, "config": {EngineConfig fields},
"requests": [[arrival step, prompt ids, max_tokens], ...], "abort": {index: step},
"kill_rank": [rank, step] (rank 0 kills that rank's process at that step), "pids": {rank: pid}}.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import mlx.core as mx

import baselm  # noqa: F401  the optimized BLAS first
from baselm.config import EngineConfig, SpeculativeConfig
from baselm.dist.group import RankFailedError
from baselm.dist.pd_engine import PDEngine
from baselm.dist.pd_launch import make_node, share_cores
from baselm.dist.pd_node import Layout, serve
from baselm.dist.watchdog import Watchdog
from baselm.sampling import SamplingParams


def load(spec: dict):
    if spec["model"] == "fixture":
        from tests.tiny_model import loaded_fixture

        return loaded_fixture("llama")
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


def run_workload(engine: PDEngine, spec: dict) -> dict:
    """Feeds requests at their arrival steps; aborts and kills on schedule; returns ids, finish reasons, errors."""
    requests = spec["requests"]
    aborts = {int(i): step for i, step in spec.get("abort", {}).items()}
    kill = spec.get("kill_rank")
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    errors: list[str] = []
    step = 0
    while step <= max(r[0] for r in requests) or engine.has_unfinished:
        for i, (arrival, prompt, max_tokens) in enumerate(requests):
            if arrival == step:
                engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), f"r{i}")
                tokens[f"r{i}"] = []
            if aborts.get(i) == step:
                engine.abort(f"r{i}")
        if kill is not None and kill[1] == step:  # [rank, step, signal name]: SIGKILL dies, SIGSTOP hangs
            os.kill(spec["pids"][str(kill[0])], getattr(signal, kill[2] if len(kill) > 2 else "SIGKILL"))
        try:
            outputs = engine.step()
        except RankFailedError as exc:
            errors.append(str(exc))
            outputs = []
        for out in outputs:
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return {"tokens": tokens, "reasons": reasons, "errors": errors, "steps": step}


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
        engine.stop()
    else:
        stats = engine.fallback.stats()
        result["fallback_free_blocks"] = [stats.num_free_blocks, engine.fallback.kv_manager.num_blocks]
    print("RESULT " + json.dumps(result), flush=True)


def vars_of(stats) -> dict:
    return {name: getattr(stats, name) for name in stats.__slots__}


if __name__ == "__main__":
    main()
