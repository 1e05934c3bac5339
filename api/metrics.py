"""Server metrics in the Prometheus text format (version 0.0.4), kept by hand: counters,
gauges read from each loaded model's scheduler at scrape time, and two latency histograms;
every series carries a `model` label."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from baselm import cpu

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, their sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.num += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The series of this histogram; `labels` (as 'model="x",') go before each bucket's bound."""
        out = [f'{name}_bucket{{{labels}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        tail = f"{{{labels.rstrip(',')}}}" if labels else ""
        out += [f'{name}_bucket{{{labels}le="+Inf"}} {self.num}', f"{name}_sum{tail} {self.total}"]
        return out + [f"{name}_count{tail} {self.num}"]


class ModelMetrics:
    """One model's counters and latency histograms; safe to update from any thread (the lock is the server's)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def count_tokens(self, num_prompt: int, num_generated: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt
            self.generation_tokens += num_generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)


class Metrics:
    """What the server counts, every series labelled by model; safe to update from any thread.

    A model keeps its counters when it is unloaded (they count since the server started); its
    gauges are read from its engine, so only a loaded model has them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int, str]] = Counter()  # (endpoint, status, model) -> count
        self.models: dict[str, ModelMetrics] = {}  # model name -> its series

    def for_model(self, model_name: str) -> ModelMetrics:
        """The series of `model_name`, made on first use."""
        with self._lock:
            return self.models.setdefault(model_name, ModelMetrics(self._lock))

    def count_request(self, endpoint: str, status: int, model_name: str = "") -> None:
        """Counts a response; `model_name` "" for a request that named no model."""
        with self._lock:
            self.requests[(endpoint, status, model_name)] += 1

    def render(self, stats: dict[str, Any]) -> str:
        """The exposition text; `stats`: each loaded model's SchedulerStats, read on its engine's thread."""
        with self._lock:
            lines = [
                "# HELP base_requests_total HTTP requests by endpoint, status code and model.",
                "# TYPE base_requests_total counter",
                *(
                    f'base_requests_total{{endpoint="{e}",status="{s}",model="{m}"}} {n}'
                    for (e, s, m), n in sorted(self.requests.items())
                ),
            ]
            lines += _token_lines(self.models)
        for model_name, model_stats in sorted(stats.items()):
            lines += _engine_lines(model_stats, f'model="{model_name}"')
        lines += _pool_lines()
        return "\n".join(lines) + "\n"


def _pool_lines() -> list[str]:
    """The CPU KV pools' resident bytes (their pages become resident as blocks are first written);
    none without the CPU kernels (0 where no pool is theirs)."""
    if not cpu.available():
        return []
    name = "base_kv_pool_resident_bytes"
    help_text = "Bytes of the CPU KV pools resident in memory (a page is, once a block on it was written)."
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {cpu.kernels.mapped_resident_bytes()}"]


def _token_lines(models: dict[str, ModelMetrics]) -> list[str]:
    """Token counters and latency histograms of every model (under the metrics' lock)."""
    named = sorted(models.items())
    lines = ["# TYPE base_prompt_tokens_total counter"]
    lines += [f'base_prompt_tokens_total{{model="{name}"}} {m.prompt_tokens}' for name, m in named]
    lines += ["# TYPE base_generation_tokens_total counter"]
    lines += [f'base_generation_tokens_total{{model="{name}"}} {m.generation_tokens}' for name, m in named]
    lines += [
        "# HELP base_time_to_first_token_seconds From request arrival to its first token.",
        "# TYPE base_time_to_first_token_seconds histogram",
    ]
    for name, m in named:
        lines += m.ttft.lines("base_time_to_first_token_seconds", f'model="{name}",')
    lines += [
        "# HELP base_inter_token_latency_seconds Between consecutive outputs of a stream.",
        "# TYPE base_inter_token_latency_seconds histogram",
    ]
    for name, m in named:
        lines += m.itl.lines("base_inter_token_latency_seconds", f'model="{name}",')
    return lines


def _engine_lines(stats: Any, label: str) -> list[str]:
    """One loaded model's gauges and counters, read from its engine."""
    lines: list[str] = []
    total_blocks = stats.num_used_blocks + stats.num_free_blocks
    gauges = [
        ("base_num_requests_running", "Requests in the running batch.", stats.num_running),
        ("base_num_requests_waiting", "Requests waiting to start.", stats.num_waiting),
        ("base_kv_blocks_used", "KV cache blocks in use.", stats.num_used_blocks),
        ("base_kv_blocks_total", "KV cache blocks in the pool.", total_blocks),
        ("base_kv_cache_usage", "Fraction of KV cache blocks in use.", stats.kv_usage),
        ("base_prefix_cache_hit_rate", "Prefix-cache hits over queries, in tokens.", stats.prefix_cache_hit_rate),
        ("base_spec_acceptance_rate", "Speculative tokens accepted over verified.", stats.spec_acceptance_rate),
        (
            "base_spec_accepted_tokens_per_step",
            "Tokens a request that verifies speculative tokens emits per step.",
            stats.spec_accepted_tokens_per_step,
        ),
    ]
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{label}}} {value}"]
    counters = [
        ("base_prefix_cache_queries_total", stats.prefix_cache_queries),
        ("base_prefix_cache_hits_total", stats.prefix_cache_hits),
        ("base_num_preemptions_total", stats.num_preemptions),
        ("base_spec_draft_tokens_total", stats.spec_num_draft_tokens),
        ("base_spec_accepted_tokens_total", stats.spec_num_accepted_tokens),
    ]
    for name, value in counters:
        lines += [f"# TYPE {name} counter", f"{name}{{{label}}} {value}"]
    return lines + _pd_lines(stats, label)


def _pd_lines(stats: Any, label: str) -> list[str]:
    """A prefill/decode group's KV handoff counters (none in one process)."""
    if getattr(stats, "kv_bytes_shipped", None) is None:
        return []
    counters = [
        ("base_pd_kv_bytes_shipped_total", "KV bytes prefill ranks sent to decode ranks.", stats.kv_bytes_shipped),
        ("base_pd_kv_blocks_shipped_total", "KV blocks prefill ranks sent to decode ranks.", stats.kv_blocks_shipped),
        (
            "base_pd_kv_blocks_skipped_total",
            "Prompt KV blocks not sent: the decode rank held them already.",
            stats.kv_blocks_skipped,
        ),
    ]
    lines = []
    for name, help_text, value in counters:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{{{label}}} {value}"]
    return lines
