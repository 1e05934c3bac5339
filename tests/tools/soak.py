"""A real `base serve` under a bad client, then under minutes of mixed load with a restart in the middle.

    .venv/bin/python -m tests.tools.soak MODEL [--minutes 30] [--concurrency 12] [--seed 0] [--json]

MODEL is anything `base serve` takes (a store name, a GGUF or .base path). The server runs in its own
process on a free loopback port, with a prefix-cache file and a 3-second read timeout. Throughout, a
prober asks `/health` every 50 ms and the server's RSS is read every second.

1. **Abuse** (the server otherwise idle): a foreign Host and a foreign Origin on every route, a body
   not declared JSON, one over the body limit and one nested 100,000 deep on every POST route, huge
   lists in every list field, 40 connections that trickle their headers or body, bad logit_bias keys,
   and clients that vanish mid-answer on each API, streamed or whole. Each must be a 4xx (a vanished
   client: no answer at all), every `/health` answered within 200 ms, and the RSS back within 10% of
   its baseline within 30 s, both less the KV pools' resident pages (`/metrics`
   `base_kv_pool_resident_bytes`: a CPU pool's pages become resident as its blocks are first written,
   so answered requests grow it, up to the pool's size, which the soak's flat-RSS check bounds)
   (`--no-latency-target`: every `/health` answered, its latency
   reported but not judged, as the test suite runs it).
Before it, a warm-up of normal use, twice (one request of each kind, all at once, a 400-token answer
and a long /tokenize), then the least of three readings is the RSS baseline.

2. **Soak**: `--concurrency` workers send a seeded mix of chat, completions, embeddings, Responses,
   Messages and Ollama requests, a sixth of the streams dropped after a few events. At half time the
   server gets SIGTERM (it must exit 0 having saved its prefix cache) and starts again from the same
   file; the first request after the restart must hit the restored cache. No answer may be a 5xx.
   At the end no request runs and no KV block is held (`/metrics`), and the RSS of the second run's
   last quarter is within 10% of its first reading after warm-up.

It prints one line per check and a summary (`--json`: the whole report) and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.tools import abuse as bad_client
from tests.tools.abuse import Report

HEALTH_TARGET_S = 0.200
RSS_TOLERANCE = 0.10
READ_TIMEOUT_S = 3.0
WARM_UP_REQUESTS = 8
AFTER_ABUSE_S = 30.0  # the longest wait for the RSS to come back after the abuse
SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 8  # a shared prefix worth caching


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`base serve MODEL` in a child process; its output kept in a log file."""

    def __init__(self, model: str, port: int, cache_file: Path, log: Path) -> None:
        command = [sys.executable, "-m", "baselm.cli", "serve", model, "--port", str(port)]
        command += ["--prefix-cache-file", str(cache_file), "--read-timeout", str(READ_TIMEOUT_S)]
        command += ["--max-body", "1MiB", "--served-model-name", "soak"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"base serve exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"base serve did not answer /health within 300 s; see {log}")

    def rss(self) -> int:
        """The server's resident memory in bytes (0 once it has exited)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kv_resident(self) -> int:
        """The bytes of the server's KV pools resident in memory (`/metrics`; 0 when it says none)."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return 0
        for line in text.splitlines():
            if line.startswith("base_kv_pool_resident_bytes "):
                return int(float(line.split()[1]))
        return 0

    def stop(self) -> int:
        """SIGTERM, then the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


@dataclass
class Watch:
    """What the prober and the RSS reader saw: every /health latency and RSS reading, by phase."""

    server: Server
    phase: str = "start"
    health: dict[str, list[float]] = field(default_factory=dict)
    health_failures: Counter = field(default_factory=Counter)
    rss: dict[str, list[int]] = field(default_factory=dict)
    # RSS less the KV pools' resident pages, read beside it: a pool's pages become resident as its
    # blocks are first written, which any answered request does, up to the whole pool (by design)
    beside_kv: dict[str, list[int]] = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)
    after_abuse_s: float = 0.0  # how long the RSS readings after the abuse went on

    def start(self) -> None:
        threading.Thread(target=self._probe, daemon=True).start()
        threading.Thread(target=self._read_rss, daemon=True).start()

    def _probe(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stopped.wait(0.05):
                began = time.monotonic()
                try:
                    ok = http.get(f"{self.server.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.health.setdefault(self.phase, []).append(time.monotonic() - began)
                elif self.phase != "restart":
                    self.health_failures[self.phase] += 1

    def _read_rss(self) -> None:
        while not self.stopped.wait(1.0):
            phase, rss = self.phase, self.server.rss()
            if rss:
                self.rss.setdefault(phase, []).append(rss)
                self.beside_kv.setdefault(phase, []).append(rss - self.server.kv_resident())


def back_within_tolerance(before: int, after: int) -> bool:
    """An RSS reading `after` within RSS_TOLERANCE above `before`."""
    return after <= before * (1 + RSS_TOLERANCE)


def baseline(watch: Watch) -> int:
    """RSS less the KV pools' resident pages after the warm-up: the least of its readings, as after the
    abuse (the server hands freed memory back once it has been idle a second)."""
    return min(watch.beside_kv.get("after warm-up", [0]))


def abuse(server: Server, watch: Watch, report: Report, model: str) -> None:
    watch.phase = "abuse"
    bad_client.run(server.url, report, model, READ_TIMEOUT_S)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        wait_idle(http, 120)
    watch.phase = "after abuse"
    # RSS readings until one is back within the tolerance (the server hands freed memory back once
    # it has been idle a second, later on a loaded machine), for at most AFTER_ABUSE_S; at least three
    before = baseline(watch)
    began = time.monotonic()
    while time.monotonic() - began < AFTER_ABUSE_S:
        time.sleep(1)
        after = watch.beside_kv.get("after abuse", [])
        if len(after) >= 3 and back_within_tolerance(before, min(after)):
            break
    watch.after_abuse_s = time.monotonic() - began


# --- soak ----------------------------------------------------------------------------------------


def _request(rng: random.Random, model: str) -> tuple[str, str, dict[str, Any], bool]:
    """(kind, path, body, stream) of one seeded request."""
    question = rng.choice(["What is the capital of France?", "Name a colour.", "Say hello.", "What is 2 + 2?"])
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    stream = rng.random() < 0.5
    kinds = [
        ("chat", "/v1/chat/completions", {"messages": chat, "max_tokens": rng.randint(4, 48), "stream": stream}),
        (
            "completions",
            "/v1/completions",
            {"prompt": SYSTEM + question, "max_tokens": rng.randint(4, 32), "stream": stream},
        ),
        ("embeddings", "/v1/embeddings", {"input": [question] * rng.randint(1, 8)}),
        ("responses", "/v1/responses", {"input": chat, "max_output_tokens": rng.randint(16, 48), "stream": stream}),
        (
            "messages",
            "/v1/messages",
            {"system": SYSTEM, "messages": chat[1:], "max_tokens": rng.randint(4, 48), "stream": stream},
        ),
        (
            "ollama-chat",
            "/api/chat",
            {"messages": chat, "stream": stream, "options": {"num_predict": rng.randint(4, 48)}},
        ),
        ("ollama-generate", "/api/generate", {"prompt": question, "stream": stream, "options": {"num_predict": 24}}),
        ("ollama-embed", "/api/embed", {"input": [question, SYSTEM]}),
    ]
    kind, path, body = rng.choice(kinds)
    return kind, path, {"model": model, **body}, body.get("stream", False)


def _send(http: httpx.Client, rng: random.Random, model: str, report: Report, restarting: threading.Event) -> None:
    kind, path, body, stream = _request(rng, model)
    drop_after = rng.randint(1, 4) if stream and rng.random() < 1 / 6 else 0
    try:
        if stream:
            with http.stream("POST", path, json=body) as answer:
                status = answer.status_code
                for i, _ in enumerate(answer.iter_lines()):
                    if drop_after and i >= drop_after:
                        kind += " (dropped)"
                        break
        else:
            status = http.post(path, json=body).status_code
    except httpx.HTTPError:
        status = 0
    if status == 0 and restarting.is_set():
        report.soak["refused while restarting"] += 1
        time.sleep(0.2)  # the server is starting again: ask again shortly
        return
    report.soak[f"{kind} {status}"] += 1
    if status >= 500 or status == 0:
        report.soak["5xx or no answer"] += 1


def _workers(
    servers: list[Server],
    model: str,
    report: Report,
    args: argparse.Namespace,
    until: list[float],
    restarting: threading.Event,
) -> list[threading.Thread]:
    def work(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < until[0]:
                http.base_url = servers[-1].url
                _send(http, rng, model, report, restarting)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(args.concurrency)]
    for thread in threads:
        thread.start()
    return threads


def metrics(http: httpx.Client) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def wait_idle(http: httpx.Client, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        busy = m["base_num_requests_running"] + m["base_num_requests_waiting"] + m["base_kv_blocks_used"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _cache_restored(server: Server, model: str) -> bool:
    """The first chat after a restart finds its shared system prompt in the restored prefix cache."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = metrics(http)["base_prefix_cache_hits_total"]
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
        http.post("/v1/chat/completions", json={"model": model, "messages": chat, "max_tokens": 2})
        return metrics(http)["base_prefix_cache_hits_total"] > before


def soak(first: Server, make_server, watch: Watch, report: Report, args: argparse.Namespace) -> Server:
    servers, restarting = [first], threading.Event()
    started = time.monotonic()
    until = [started + args.minutes * 60]
    watch.phase = "soak 1"
    threads = _workers(servers, "soak", report, args, until, restarting)
    time.sleep(args.minutes * 30)
    restarting.set()
    watch.phase = "restart"
    status = first.stop()
    report.check("SIGTERM mid-load exits 0", status == 0, f"exit status {status}")
    report.check("the prefix cache file was saved", args.cache_file.exists(), str(args.cache_file))
    second = make_server()
    watch.server = second
    servers.append(second)
    report.check(
        "the restarted server found its prefix cache", _cache_restored(second, "soak"), "a hit on the first chat"
    )
    restarting.clear()
    watch.phase = "soak 2"
    for thread in threads:
        thread.join(args.minutes * 60 + 300)
    watch.phase = "end"
    return second


# --- the whole run -------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _judge_abuse(watch: Watch, report: Report, latency_target: bool) -> None:
    abuse_health = watch.health.get("abuse", [])
    worst = max(abuse_health, default=0.0)
    in_time = worst <= HEALTH_TARGET_S or not latency_target
    target = f"all within {HEALTH_TARGET_S * 1000:.0f} ms" if latency_target else "all answered; latency not judged"
    report.check(
        "/health during abuse",
        bool(abuse_health) and in_time and not watch.health_failures["abuse"],
        f"{len(abuse_health)} answers, p50 {_percentile(abuse_health, 0.5) * 1000:.1f} ms, max {worst * 1000:.1f} ms, "
        f"{watch.health_failures['abuse']} failed (target: {target})",
    )
    before, after = baseline(watch), min(watch.beside_kv.get("after abuse", [0]))
    report.check(
        "RSS after abuse (less the KV pool's resident pages)",
        back_within_tolerance(before, after),
        f"{before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after, read for {watch.after_abuse_s:.0f} s "
        f"(target: within {RSS_TOLERANCE:.0%} within {AFTER_ABUSE_S:.0f} s)",
    )
    refused = not any(name.startswith("abuse:") for name, _, _ in report.checks)  # each miss was a check of its own
    report.check(
        "every abusive request refused with a 4xx (a huge list: or answered)", refused, str(dict(report.abuse))
    )


def _judge_soak(watch: Watch, report: Report, end: dict[str, float], log: Path) -> None:
    report.check(
        "no 5xx or lost answer under load",
        report.soak["5xx or no answer"] == 0,
        f"{sum(report.soak.values())} requests: {dict(sorted(report.soak.items()))}",
    )
    second = watch.rss.get("soak 2", [])
    warm = second[len(second) // 4] if second else 0
    tail = second[-max(1, len(second) // 4) :] if second else [0]
    report.check(
        "RSS flat under load",
        bool(second) and back_within_tolerance(warm, max(tail)),
        f"{warm / 2**20:.0f} MiB after warm-up, {max(tail) / 2**20:.0f} MiB at most in the last quarter",
    )
    busy = {
        name: end[name] for name in ("base_num_requests_running", "base_num_requests_waiting", "base_kv_blocks_used")
    }
    report.check("idle at the end: no request, no KV block held", not any(busy.values()), str(busy))
    text = log.read_text(errors="replace")
    report.check(
        "no traceback in the server's log", "Traceback" not in text, f"{text.count('Traceback')} tracebacks in {log}"
    )


def _figures(watch: Watch, report: Report) -> dict[str, Any]:
    abuse_health = watch.health.get("abuse", [])
    soak_health = watch.health.get("soak 1", []) + watch.health.get("soak 2", [])
    return {
        "health_abuse_ms": {
            "p50": _percentile(abuse_health, 0.5) * 1e3,
            "p99": _percentile(abuse_health, 0.99) * 1e3,
            "max": max(abuse_health, default=0) * 1e3,
        },
        "health_soak_ms": {
            "p50": _percentile(soak_health, 0.5) * 1e3,
            "p99": _percentile(soak_health, 0.99) * 1e3,
            "max": max(soak_health, default=0) * 1e3,
        },
        "rss_mib": {phase: [round(min(v) / 2**20), round(max(v) / 2**20)] for phase, v in watch.rss.items()},
        "requests": dict(sorted(report.soak.items())),
        "abuse": dict(report.abuse),
    }


def warm_up(url: str) -> None:
    """What a server does in its first minutes of normal use, before its RSS is the baseline, twice: one
    request of each kind, all at once (threads and batches as under load), a long answer (the KV pool's
    pages touched) and a long /tokenize (large buffers)."""
    with httpx.Client(base_url=url, timeout=300) as http, ThreadPoolExecutor(WARM_UP_REQUESTS) as pool:

        def send(i: int) -> None:
            _kind, path, body, _ = _request(random.Random(i), "soak")
            http.post(path, json={**body, "stream": False} if "stream" in body else body)

        for _ in range(2):
            list(pool.map(send, range(WARM_UP_REQUESTS)))
            story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
            http.post("/v1/chat/completions", json={"model": "soak", "messages": story, "max_tokens": 400})
            http.post("/tokenize", json={"prompt": "x " * 300000})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--no-latency-target",
        dest="latency_target",
        action="store_false",
        help="report /health's latency during the abuse without judging it (for the test suite: no timing asserts)",
    )
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="base-soak-"))
    args.cache_file, log, port = folder / "prefix-cache.bin", folder / "serve.log", free_port()
    report = Report()

    def make_server() -> Server:
        return Server(args.model, port, args.cache_file, log)

    server = make_server()
    watch = Watch(server)
    watch.start()
    try:
        warm_up(server.url)
        watch.phase = "after warm-up"
        time.sleep(3)  # three RSS readings, the baseline
        abuse(server, watch, report, "soak")
        server = soak(server, make_server, watch, report, args)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            end = wait_idle(http, 120)
        _judge_abuse(watch, report, args.latency_target)
        _judge_soak(watch, report, end, log)
        report.figures = _figures(watch, report)
    finally:
        watch.stopped.set()
        status = server.stop() if server.proc.poll() is None else server.proc.returncode
    report.check("the last SIGTERM exits 0", status == 0, f"exit status {status}")
    if args.json:
        print(json.dumps({"passed": report.passed, "checks": report.checks, **report.figures}, indent=1))
    else:
        print(json.dumps(report.figures, indent=1))
    verdict = "PASSED" if report.passed else "FAILED"
    print(f"{verdict}: {sum(ok for _, ok, _ in report.checks)} of {len(report.checks)} checks; log in {log}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
