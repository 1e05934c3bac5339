"""`base bench MODEL --pd P:D`: the same batch of requests in one process, then in a prefill/decode group.

Rank 0 first runs the batch on a single LLMEngine (before the other ranks exist, so they take
no CPU from it), then forms the group and runs it again through a PDEngine. It reports wall
time, time to first token, output tokens per second, the KV bytes shipped per prompt token,
and a model of the group's overheads on two Macs over Thunderbolt from published figures.

Published figures the model uses (link speeds, not measured here):
- MLX's distributed guide (https://ml-explore.github.io/mlx/build/html/usage/distributed.html):
  JACCL's latency is "an order of magnitude lower than the ring backend"; no absolute numbers.
- Apple's TN3205, as summarised in https://www.adwaitx.com/?p=10695: ~300 us over TCP,
  under 50 us with RDMA over Thunderbolt (the latency of one message).
- https://github.com/ml-explore/mlx/issues/3207: mx.distributed send/recv over JACCL on
  Thunderbolt 5 moved 3.5-3.8 GB/s; rsync over Thunderbolt 5 IP, 0.3-0.5 GB/s.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from baselm.commands.errors import report_user_errors
from baselm.commands.model import ModelArgs, load_alone
from baselm.config import EngineConfig
from baselm.distributed import group as dist_group
from baselm.distributed.pd.node import Layout
from baselm.loader import LoadedModel
from baselm.sampling.params import SamplingParams

# (name, one message's latency in seconds, bytes per second): see the module docstring.
LINKS = (
    ("ring over Thunderbolt (TCP/IP)", 300e-6, 0.4e9),
    ("jaccl (RDMA over Thunderbolt 5)", 50e-6, 3.5e9),
)
COLLECTIVES_PER_STEP = 3  # the plan's broadcast (one all_sum) and the reports' gather (two all_gathers)
COLLECTIVES_PER_HANDOFF_STEP = 7  # plus the admissions' and the first tokens' gathers, when prompts are handed off


@dataclass(slots=True)
class PDBenchOptions:
    prompt_tokens: int = 128
    gen_tokens: int = 64
    num_requests: int = 8
    seed: int = 0


def measure(engine, prompts: list[list[int]], gen_tokens: int) -> dict:
    """Runs the prompts together (greedy, ignoring EOS) to the end; times the batch and each first token."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    num_steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id] += out.token_ids
        num_steps += 1
    wall = time.perf_counter() - start
    num_out = sum(len(t) for t in tokens.values())
    return {
        "wall_s": round(wall, 3),
        "ttft_mean_s": round(float(np.mean(list(first.values()))), 3),
        "output_tokens_per_s": round(num_out / wall, 2),
        "steps": num_steps,
        "step_ms": round(1000 * wall / max(num_steps, 1), 2),
        "tokens": [tokens[rid] for rid in ids],
    }


def link_model(kv_bytes_per_prompt_token: float, prompt_tokens: int, num_steps: int, num_handoff_steps: int) -> list:
    """What the group's messages would cost per link: KV transfer per prompt, collectives per step."""
    rows = []
    for name, latency, bandwidth in LINKS:
        per_prompt = latency + kv_bytes_per_prompt_token * prompt_tokens / bandwidth
        per_step = COLLECTIVES_PER_STEP * latency
        extra = COLLECTIVES_PER_HANDOFF_STEP - COLLECTIVES_PER_STEP
        total = num_steps * per_step + num_handoff_steps * extra * latency
        rows.append(
            {
                "link": name,
                "kv_transfer_ms_per_prompt": round(1000 * per_prompt, 3),
                "collectives_ms_per_step": round(1000 * per_step, 3),
                "collectives_s_whole_run": round(total, 3),
            }
        )
    return rows


def bench_command(
    load: Callable[[], LoadedModel], config: EngineConfig, layout: Layout, options: PDBenchOptions
) -> dict | None:
    """Rank 0: the report; another rank (started by rank 0): None once the run is over."""
    from baselm.commands import serve_pd as pd_serve
    from baselm.engine import LLMEngine

    is_started_rank = bool(os.environ.get(dist_group.PARENT_ENV))
    loaded = None if is_started_rank else load()
    prompts = alone = None
    if loaded is not None:
        rng = np.random.default_rng(options.seed)
        vocab = loaded.model.args.vocab_size
        prompts = [
            rng.integers(100, min(vocab, 30000), options.prompt_tokens).tolist() for _ in range(options.num_requests)
        ]
        alone = measure(LLMEngine(loaded, config), prompts, options.gen_tokens)
    pd_options = pd_serve.PDOptions(layout)
    group = pd_serve.form_group(pd_options)
    engine = pd_serve.start(loaded or load(), config, pd_options, group)
    if engine is None:
        return None
    together = measure(engine, prompts, options.gen_tokens)
    stats = engine.sync()
    pd_serve.stop(engine, group)
    return _report(layout, options, alone, together, stats)


def _report(layout: Layout, options: PDBenchOptions, alone: dict, together: dict, stats) -> dict:
    sent = sum(s.kv_bytes_sent for s in stats)
    handed = sum(s.prompt_tokens_handed for s in stats)
    per_token = sent / handed if handed else 0.0
    same = alone.pop("tokens") == together.pop("tokens")
    return {
        "layout": str(layout),
        "prompt_tokens": options.prompt_tokens,
        "gen_tokens": options.gen_tokens,
        "num_requests": options.num_requests,
        "one_process": alone,
        "pd": together,
        "same_tokens": same,
        "kv_bytes_shipped": sent,
        "kv_bytes_per_prompt_token": round(per_token, 1),
        "kv_blocks_hit_on_decode": sum(s.kv_blocks_hit for s in stats),
        "thunderbolt_model": link_model(per_token, options.prompt_tokens, together["steps"], options.num_requests),
    }


def render(report: dict) -> None:
    one, pd = report["one_process"], report["pd"]
    print(f"{report['num_requests']} requests x ({report['prompt_tokens']} prompt + {report['gen_tokens']} generated)")
    print(f"{'':14}{'wall s':>9}{'TTFT s':>9}{'out tok/s':>11}{'steps':>7}{'ms/step':>9}")
    for name, row in (("one process", one), (f"--pd {report['layout']}", pd)):
        print(
            f"{name:14}{row['wall_s']:>9}{row['ttft_mean_s']:>9}{row['output_tokens_per_s']:>11}"
            f"{row['steps']:>7}{row['step_ms']:>9}"
        )
    print(f"same tokens: {report['same_tokens']}")
    print(f"KV shipped: {report['kv_bytes_shipped']} bytes, {report['kv_bytes_per_prompt_token']} per prompt token")
    for row in report["thunderbolt_model"]:
        print(
            f"model, {row['link']}: {row['kv_transfer_ms_per_prompt']} ms KV per prompt, "
            f"{row['collectives_ms_per_step']} ms collectives per step, {row['collectives_s_whole_run']} s in this run"
        )


@dataclass(frozen=True, slots=True)
class PDBenchArgs:
    """What `base bench MODEL --pd P:D` does. Its group is started on this machine: a model over
    processes of its own (--tensor-parallel, --hostfile, --rank) is refused beside it."""

    model: ModelArgs
    layout: Layout
    engine: EngineConfig
    options: PDBenchOptions
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.model.dist is not None:
            raise dist_group.DistError(
                "base bench --pd starts its own group on this machine: drop --tensor-parallel/--hostfile/--rank"
            )


def bench_pd(args: PDBenchArgs) -> None:
    """The `base bench --pd` command: prints the report on rank 0 (JSON with `as_json`); the other
    ranks return once the run is over."""
    with report_user_errors():
        report = bench_command(lambda: load_alone(args.model), args.engine, args.layout, args.options)
    if report is None:
        return
    if args.as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
