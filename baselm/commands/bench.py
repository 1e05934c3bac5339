"""`base bench`: measured speed of the engine on one model, as a table or JSON.

Scenarios (each run in the same process, so ratios compare like with like):
- throughput: N concurrent requests of random prompt tokens, greedy, fixed output length:
  prefill tok/s, decode tok/s per stream and aggregate, TTFT and inter-token latency
  percentiles, and where a decode step's time goes.
- prefix: a request whose first `shared_prefix` tokens are cached vs the same request cold.
- prefix_wave: the largest concurrency's requests arriving at once with a common `shared_prefix`,
  cold: TTFT and prompt tokens computed, with in-flight prefix sharing on and off.
- interleave: a long prompt arriving while streams decode: their worst gap vs median gap.
- pool: decode step time with a small and a large KV pool (in-place updates keep it flat).
- mlx_lm: mlx-lm's own generation loop on the same weights, for single-stream decode.
- speculative: each workload with and without speculative decoding (bench_spec.py).
"""

from __future__ import annotations

import importlib
import json
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from rich.markup import escape
from rich.table import Table

from baselm.commands import bench_spec
from baselm.commands.console import table_console
from baselm.commands.errors import report_user_errors
from baselm.commands.model import ModelArgs, is_follower, open_model, run_follower
from baselm.config import ConfigError, EngineConfig, SpeculativeConfig, format_size
from baselm.cpu import fused
from baselm.cpu.fused import fused_kernel_status
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.metal import kernel_status
from baselm.paged_attention import attention_kernel_status
from baselm.runner import StepStats
from baselm.sampling.params import SamplingParams

STEP_PARTS = ("schedule", "prepare", "forward", "sample", "update")


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """Which scenarios `base bench` runs and their sizes; a scenario with size 0 (or no sizes) is skipped."""

    prompt_tokens: int = 128  # prompt length of each throughput request
    gen_tokens: int = 64  # tokens generated per throughput request
    concurrency: tuple[int, ...] = (1, 4, 8)  # one throughput run per count
    shared_prefix: int = 0  # prefix: a request whose first N tokens are cached
    long_prompt: int = 0  # interleave: an N-token prompt prefilled while 4 streams decode
    chunk: int = 64  # interleave: the token budget per step
    pool_sizes: tuple[int, ...] = ()  # pool: KV pool sizes in bytes
    compare_mlx_lm: bool = False  # mlx_lm: mlx-lm's decode loop on the same weights
    compare_cpu_layer: bool = False  # cpu_layer: single-stream decode with the CPU layer kernel on and off
    seed: int = 0  # for the random prompts
    speculative: SpeculativeConfig | None = None  # speculative: compare with and without it
    workloads: tuple[str, ...] = ("grounded", "free")  # speculative: which workloads
    spec_repeats: int = 2  # speculative: alternating runs of each, best kept

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"concurrency needs one or more counts of at least 1, got {list(self.concurrency)}")
        for name in ("prompt_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.gen_tokens < 2:  # decode speed is measured between the first and the last token
            raise ConfigError(f"gen_tokens must be at least 2, got {self.gen_tokens}")
        for name in ("shared_prefix", "long_prompt"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if any(size < 1 for size in self.pool_sizes):
            raise ConfigError("pool sizes must be positive")
        if self.spec_repeats < 1:
            raise ConfigError(f"spec_repeats must be at least 1, got {self.spec_repeats}")
        unknown = [w for w in self.workloads if w not in bench_spec.WORKLOADS]
        if unknown or not self.workloads:
            raise ConfigError(f"workloads must be among {', '.join(bench_spec.WORKLOADS)}, got {list(self.workloads)}")


@dataclass(frozen=True, slots=True)
class BenchArgs:
    """What `base bench MODEL` does: the model, its engine's settings, the scenarios, how to print."""

    model: ModelArgs
    engine: EngineConfig
    options: BenchOptions
    as_json: bool = False


def bench(args: BenchArgs) -> None:
    """Loads the model, runs the scenarios and prints the report. A rank other than 0 of a
    tensor-parallel group follows rank 0 instead, and ends the process with it."""
    with report_user_errors():
        loaded, group = open_model(args.model)
        if is_follower(group):
            raise SystemExit(run_follower(loaded, group, args.model.dist))
        report = {**run_all(loaded, args.engine, args.options), "distributed": None}
        if group is not None:
            from baselm.distributed.tp.launch import describe

            report["distributed"] = describe(loaded)
    if args.as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
        print(f"distributed: {json.dumps(report['distributed'])}" if report["distributed"] else "", end="")


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class Trace:
    """Token arrival times of one request, relative to when it was added."""

    added: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.added

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class Runner:
    """Drives an engine step by step, timestamping every token of every request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.traces: dict[str, Trace] = {}
        self.steps: list[StepStats] = []

    def add(self, prompt_ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request_id = self.engine.add_request(prompt_ids, params)
        self.traces[request_id] = Trace(time.perf_counter())
        return request_id

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        self.steps.append(self.engine.last_step)
        for out in outputs:
            trace = self.traces.get(out.request_id)
            if trace is not None:
                trace.token_times += [now] * len(out.token_ids)

    def run_until_done(self) -> None:
        while self.engine.has_unfinished:
            self.step()


def random_prompt(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(100, min(vocab, 30000), n).tolist()


def step_breakdown(steps: list[StepStats]) -> dict[str, float]:
    """Mean milliseconds per part over decode-only steps (one token per sequence)."""
    decode = [s for s in steps if s.num_seqs and s.num_tokens == s.num_seqs] or steps
    parts = {p: 1000 * statistics.fmean(getattr(s, p) for s in decode) for p in STEP_PARTS}
    total = sum(parts.values())
    parts["total"] = total
    parts["overhead_pct"] = 100 * (total - parts["forward"] - parts["sample"]) / total if total else 0.0
    return {k: round(v, 3) for k, v in parts.items()}


def throughput(engine: LLMEngine, concurrency: int, prompt_tokens: int, gen_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    runner = Runner(engine)
    start = time.perf_counter()
    for _ in range(concurrency):
        runner.add(random_prompt(rng, engine.vocab_size, prompt_tokens), gen_tokens)
    runner.run_until_done()
    elapsed = time.perf_counter() - start
    traces = list(runner.traces.values())
    first = max(t.token_times[0] for t in traces)
    last = max(t.token_times[-1] for t in traces)
    per_stream = [(len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0]) for t in traces]
    gaps = [g for t in traces for g in t.gaps]
    ttfts = [t.ttft for t in traces]
    return {
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_tok_s": round(concurrency * prompt_tokens / (first - start), 1),
        "decode_tok_s_per_stream": round(statistics.median(per_stream), 2),
        "decode_tok_s_aggregate": round(concurrency * (gen_tokens - 1) / (last - first), 2) if last > first else 0.0,
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p95_ms": round(1000 * percentile(ttfts, 95), 1),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 2),
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 2),
        "elapsed_s": round(elapsed, 2),
        "step_ms": step_breakdown(runner.steps),
    }


def prefix_cache(engine: LLMEngine, shared_prefix: int, seed: int) -> dict:
    """TTFT of a request whose first `shared_prefix` tokens are cached, vs. the same request cold."""
    rng = np.random.default_rng(seed)
    prefix = random_prompt(rng, engine.vocab_size, shared_prefix)
    suffix_a, suffix_b = (random_prompt(rng, engine.vocab_size, 16) for _ in range(2))
    cold = Runner(engine)
    cold.add(prefix + suffix_a, 1)
    cold.run_until_done()
    warm = Runner(engine)
    warm.add(prefix + suffix_b, 1)
    warm.run_until_done()
    cold_ttft = next(iter(cold.traces.values())).ttft
    warm_ttft = next(iter(warm.traces.values())).ttft
    return {
        "shared_prefix": shared_prefix,
        "cold_ttft_ms": round(1000 * cold_ttft, 1),
        "cached_ttft_ms": round(1000 * warm_ttft, 1),
        "speedup": round(cold_ttft / warm_ttft, 2),
    }


def prefix_wave(engine: LLMEngine, shared_prefix: int, concurrency: int, gen_tokens: int, seed: int) -> dict:
    """`concurrency` requests arriving at once whose first `shared_prefix` tokens are the same, cold cache:
    mean TTFT and prompt tokens computed, with in-flight prefix sharing on and off (side by side)."""
    rng = np.random.default_rng(seed + 1)
    suffix_len = 47
    report: dict[str, Any] = {"shared_prefix": shared_prefix, "concurrency": concurrency, "suffix": suffix_len}
    for share in (True, False):
        prefix = random_prompt(rng, engine.vocab_size, shared_prefix)  # fresh each time: a cold cache
        engine.kv_manager.reset_prefix_cache()
        engine.scheduler.share_inflight_prefixes = share
        before = engine.stats()
        runner = Runner(engine)
        for _ in range(concurrency):
            runner.add(prefix + random_prompt(rng, engine.vocab_size, suffix_len), gen_tokens)
        runner.run_until_done()
        after = engine.stats()
        computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (
            after.prefix_cache_hits - before.prefix_cache_hits
        )
        ttfts = [t.ttft for t in runner.traces.values()]
        report["shared" if share else "unshared"] = {
            "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
            "ttft_max_ms": round(1000 * max(ttfts), 1),
            "prompt_tokens_computed": computed,
            "computed_over_minimum": round(computed / (shared_prefix + concurrency * suffix_len), 3),
        }
    engine.scheduler.share_inflight_prefixes = True
    return report


def interleave(engine: LLMEngine, long_prompt: int, num_streams: int, seed: int) -> dict:
    """Streams decoding while a long prompt is prefilled in chunks: their worst gap vs median gap."""
    rng = np.random.default_rng(seed)
    runner = Runner(engine)
    budget = 512  # streams are aborted long before this
    streams = [runner.add(random_prompt(rng, engine.vocab_size, 32), budget) for _ in range(num_streams)]
    for _ in range(8):  # let the streams settle into decoding
        runner.step()
    marks = {rid: len(runner.traces[rid].token_times) for rid in streams}
    long_id = runner.add(random_prompt(rng, engine.vocab_size, long_prompt), 4)
    while not runner.traces[long_id].token_times:  # the prompt is prefilled chunk by chunk
        runner.step()
    for rid in streams:
        engine.abort(rid)
    runner.run_until_done()
    gaps = [g for rid in streams for g in runner.traces[rid].gaps[marks[rid] :]]
    median = statistics.median(gaps)
    return {
        "long_prompt": long_prompt,
        "num_streams": num_streams,
        "long_prompt_ttft_ms": round(1000 * runner.traces[long_id].ttft, 1),
        "stream_gap_median_ms": round(1000 * median, 2),
        "stream_gap_max_ms": round(1000 * max(gaps), 2),
        "max_over_median": round(max(gaps) / median, 2),
    }


def run_all(loaded: LoadedModel, config: EngineConfig, options: BenchOptions) -> dict[str, Any]:
    """Every scenario the options ask for, in one process; returns the JSON report."""
    engine = LLMEngine(loaded, config)
    report: dict[str, Any] = {
        "model": loaded.name,
        "backend": loaded.backend.name,
        "matmuls": loaded.backend.linear_path,
        "attention": {**kernel_status(), **attention_kernel_status(), **fused_kernel_status()},
        "kv_pool_bytes": engine.cache.nbytes,
        "kv_blocks": engine.kv_manager.num_blocks,
        "config": {k: getattr(config, k) for k in config.__slots__ if k != "speculative"},
        "throughput": [],
    }
    throughput(engine, 1, 16, 4, options.seed)  # warm-up: first-call allocations and compilation
    for concurrency in options.concurrency:
        report["throughput"].append(
            throughput(engine, concurrency, options.prompt_tokens, options.gen_tokens, options.seed)
        )
    if options.shared_prefix:
        report["prefix_cache"] = prefix_cache(engine, options.shared_prefix, options.seed)
        wave = max(options.concurrency)
        if wave > 1:
            report["prefix_wave"] = prefix_wave(engine, options.shared_prefix, wave, options.gen_tokens, options.seed)
    if options.long_prompt:
        chunked = LLMEngine(loaded, replace(config, max_num_batched_tokens=options.chunk))
        report["interleave"] = interleave(chunked, options.long_prompt, 4, options.seed)
        del chunked
    if options.compare_cpu_layer:
        report["cpu_layer"] = cpu_layer_ab(engine, options)
    del engine
    if options.pool_sizes:
        report["pool"] = pool_sizes(loaded, config, options.pool_sizes, options.gen_tokens, options.seed)
    if options.speculative is not None:
        report["speculative"] = bench_spec.compare(loaded, config, options.speculative, options)
    if options.compare_mlx_lm:
        report["mlx_lm"] = mlx_lm_decode(loaded, config, options.prompt_tokens, options.gen_tokens, options.seed)
    report["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return report


def render(report: dict[str, Any]) -> None:
    """The report as rich tables: throughput and latency, where each step's time went, and with
    --speculative the side-by-side runs. Headers are short words in two lines, so an 80-column
    terminal wraps no header word and cuts no value."""
    console = table_console()
    console.print(
        f"[bold]{report['model']}[/] on {report['backend']}, KV pool {format_size(report['kv_pool_bytes'], 'MiB', 0)} "
        f"({report['kv_blocks']} blocks), peak RSS {report['peak_rss_mb']:.0f} MiB"
    )
    console.print(f"matmuls: {report['matmuls']}", highlight=False)
    console.print("attention: " + ", ".join(f"{k} {v}" for k, v in report["attention"].items()), highlight=False)
    console.print(_throughput_table(report["throughput"]))
    console.print(_steps_table(report["throughput"]))
    if "speculative" in report:
        spec = Table(*bench_spec.COLUMNS, title="with and without speculative decoding")
        for row in bench_spec.render_rows(report["speculative"]):
            spec.add_row(*row)
        console.print(spec)
    for key in ("prefix_cache", "prefix_wave", "interleave", "cpu_layer", "pool", "mlx_lm"):
        if key in report:
            values = ", ".join(f"{k}={v}" for k, v in report[key].items())
            console.print(f"[bold]{key}[/]: {escape(values)}", highlight=False)  # escaped: "[bench]" is not markup


def _throughput_table(rows: list[dict[str, Any]]) -> Table:
    headers = ("streams", "prefill\ntok/s", "decode tok/s\nper stream", "decode tok/s\nin total", "TTFT ms\np50 / p95")
    table = Table(*headers, "ITL ms\np50 / p99", title="throughput and latency")
    for r in rows:
        table.add_row(
            str(r["concurrency"]),
            f"{r['prefill_tok_s']:.0f}",
            f"{r['decode_tok_s_per_stream']:.1f}",
            f"{r['decode_tok_s_aggregate']:.1f}",
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f}",
            f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}",
        )
    return table


def _steps_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("streams", "schedule", "prepare", "forward", "sample", "update", "overhead", title="ms per step")
    for r in rows:
        s = r["step_ms"]
        times = (f"{s['schedule']:.2f}", f"{s['prepare']:.2f}", f"{s['forward']:.1f}", f"{s['sample']:.2f}")
        table.add_row(str(r["concurrency"]), *times, f"{s['update']:.2f}", f"{s['overhead_pct']:.1f}%")
    return table


def cpu_layer_ab(engine: LLMEngine, options: BenchOptions, rounds: int = 4) -> dict:
    """Single-stream decode with the CPU decoder-layer kernel on and off (`BASE_CPU_LAYER`), alternating
    on one engine with the order flipped each round, so load drift on a shared machine hits both:
    each side's median and the median of the paired ratios."""
    if not fused.kernel_applies(mx.zeros((1,), dtype=mx.float32)):
        return {"skipped": "the CPU kernels do not run here"}
    runs: dict[bool, list[dict]] = {True: [], False: []}
    before = fused.layer_enabled
    try:
        for i in range(rounds):
            for enabled in (True, False) if i % 2 == 0 else (False, True):
                fused.layer_enabled = enabled
                runs[enabled].append(throughput(engine, 1, options.prompt_tokens, options.gen_tokens, options.seed + i))
    finally:
        fused.layer_enabled = before
    tok_s = {k: [r["decode_tok_s_per_stream"] for r in v] for k, v in runs.items()}
    forward = {k: [r["step_ms"]["forward"] for r in v] for k, v in runs.items()}
    return {
        "rounds": rounds,
        "decode_tok_s_on": round(statistics.median(tok_s[True]), 2),
        "decode_tok_s_off": round(statistics.median(tok_s[False]), 2),
        "forward_ms_on": round(statistics.median(forward[True]), 3),
        "forward_ms_off": round(statistics.median(forward[False]), 3),
        "paired_ratio": round(statistics.median(a / b for a, b in zip(tok_s[True], tok_s[False])), 3),
    }


def pool_sizes(loaded: LoadedModel, base: EngineConfig, sizes: Sequence[int], gen_tokens: int, seed: int) -> dict:
    """Decode step time at concurrency 1 for each KV pool size (alternating runs, best of 3)."""
    engines = {size: LLMEngine(loaded, replace(base, kv_memory=size, max_num_seqs=1)) for size in sizes}
    best = {size: float("inf") for size in sizes}
    for _ in range(3):
        for size, engine in engines.items():
            result = throughput(engine, 1, 64, gen_tokens, seed)
            best[size] = min(best[size], result["step_ms"]["total"])
    small, large = min(sizes), max(sizes)
    out = {f"{size / 2**20:.0f}MiB_step_ms": round(best[size], 3) for size in sizes}
    out["large_over_small"] = round(best[large] / best[small], 3)
    return out


def _quantize_like(model: Any, ours: Any) -> None:
    """Makes mlx-lm's layers quantized where ours are (same bits and group size), so our arrays load into them."""
    import mlx.nn as nn

    formats = {
        (path if path.startswith("lm_head") else f"model.{path}"): {"group_size": m.group_size, "bits": m.bits}
        for path, m in ours.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    }
    if formats:
        nn.quantize(
            model, class_predicate=lambda path, m: formats.get(path, False) if hasattr(m, "to_quantized") else False
        )


def mlx_lm_decode(loaded: LoadedModel, config: EngineConfig, prompt_tokens: int, gen_tokens: int, seed: int) -> dict:
    """Single-stream decode: mlx-lm's generate_step on our loaded weights (the same arrays) vs
    our engine, alternating three times and keeping each one's best run."""
    try:  # an optional dependency (the `bench` extra)
        from mlx_lm.generate import generate_step
    except ImportError:
        return {"error": "mlx-lm is not installed (pip install -e .[bench])"}
    module = importlib.import_module(f"mlx_lm.models.{loaded.config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(loaded.config))
    _quantize_like(model, loaded.model)  # weights kept quantized (CPU kernels, GPUs): mlx-lm's quantized layers
    ours = tree_flatten(loaded.model.parameters())
    model.load_weights([(k if k.startswith("lm_head") else f"model.{k}", v) for k, v in ours], strict=False)
    mx.eval(model.parameters())
    prompt = mx.array(random_prompt(np.random.default_rng(seed), loaded.model.args.vocab_size, prompt_tokens))
    engine = LLMEngine(loaded, replace(config, max_num_seqs=1))
    theirs, base = 0.0, 0.0
    for _ in range(3):
        times = []
        for _ in generate_step(prompt, model, max_tokens=gen_tokens):
            times.append(time.perf_counter())
        theirs = max(theirs, (len(times) - 1) / (times[-1] - times[0]))
        base = max(base, throughput(engine, 1, prompt_tokens, gen_tokens, seed)["decode_tok_s_per_stream"])
    return {
        "mlx_lm_decode_tok_s": round(theirs, 2),
        "base_decode_tok_s": round(base, 2),
        "base_over_mlx_lm": round(base / theirs, 3),
    }
