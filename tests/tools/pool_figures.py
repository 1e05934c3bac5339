"""Figures of `base serve` with no model (api/pool.py): a model's load time, the time to first token
of a cold model (its load included) and of a warm one, and the server's RSS with 0, 1 and 2 models
loaded, after they unload, and after loading and unloading both once more; and how two loaded
models share the CPU when both answer at once.

The store is a temporary one holding SmolLM2-135M-Instruct (its Q4_1 GGUF, fetched once as the tests
do) under two names; both names point at one file, and each loads as a model of its own (its own
weights in memory, its own engine). Run: .venv/bin/python tests/tools/pool_figures.py [--kv-memory 64MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _store(home: Path) -> list[str]:
    """The temporary store: SmolLM2 imported, then copied under a second name."""
    from baselm.models import supported_model_types
    from baselm.store.default_model import fetch_default_gguf
    from baselm.store.import_local import import_local
    from baselm.store.registry import Store

    store = Store(home)
    first = import_local(fetch_default_gguf(), supported=set(supported_model_types()), store=store)
    second = store.copy(first.ref, "smollm2-second")
    return [first.ref, second.ref]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _first_token_seconds(url: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content token."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True}
    body["temperature"] = 0
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - started
    raise RuntimeError("no token came")


def _shares(url: str, models: list[str], streams: int = 4, tokens: int = 64) -> dict[str, float]:
    """Each model's decode tok/s while both answer `streams` requests at once (two engines sharing
    the CPU), and the slower's share of the faster's: 1.0 is an even split."""
    from concurrent.futures import ThreadPoolExecutor

    def one(model: str) -> tuple[str, int, float]:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0}
        body["ignore_eos"] = True
        started = time.perf_counter()
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return model, answer["usage"]["completion_tokens"], time.perf_counter() - started

    with ThreadPoolExecutor(len(models) * streams) as pool:
        done = list(pool.map(one, [m for m in models for _ in range(streams)]))
    rates = {m: sum(n for name, n, _ in done if name == m) / max(s for name, _, s in done if name == m) for m in models}
    slower, faster = sorted(rates.values())
    return {"two_engines_tok_s_min": slower, "two_engines_tok_s_max": faster, "two_engines_share": slower / faster}


def _wait_unloaded(url: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/api/ps", timeout=30).json()["models"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the models did not unload")
        time.sleep(0.05)


def measure(kv_memory: str) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="base-pool-figures-"))
    models = _store(home)
    port = _free_port()
    env = {**os.environ, "BASE_HOME": str(home)}
    command = [sys.executable, "-m", "baselm.cli", "serve", "--port", str(port), "--keep-alive", "-1"]
    server = subprocess.Popen(
        [*command, "--kv-memory", kv_memory], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    figures: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("base serve did not start")
            time.sleep(0.1)
        figures["rss_0_models_mib"] = _rss_mib(server.pid)
        started = time.perf_counter()
        httpx.post(f"{url}/models/load", json={"model": models[0]}, timeout=300).raise_for_status()
        figures["load_seconds"] = time.perf_counter() - started
        figures["rss_1_model_mib"] = _rss_mib(server.pid)
        figures["warm_ttft_seconds"] = min(_first_token_seconds(url, models[0]) for _ in range(3))
        figures["cold_ttft_seconds"] = _first_token_seconds(url, models[1])  # loads the second model first
        figures["rss_2_models_mib"] = _rss_mib(server.pid)
        figures |= _shares(url, models)
        for model in models:
            httpx.post(f"{url}/models/unload", json={"model": model}, timeout=60).raise_for_status()
        _wait_unloaded(url)
        figures["rss_after_unload_mib"] = _rss_mib(server.pid)
        for model in models:  # once more: what the first loads left (imports, caches) stays, a load adds nothing
            httpx.post(f"{url}/models/load", json={"model": model}, timeout=300).raise_for_status()
        figures["rss_2_models_again_mib"] = _rss_mib(server.pid)
        for model in models:
            httpx.post(f"{url}/models/unload", json={"model": model}, timeout=60).raise_for_status()
        _wait_unloaded(url)
        figures["rss_after_second_unload_mib"] = _rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-memory", default="64MiB", help="each model's KV pool (base serve --kv-memory)")
    args = parser.parse_args()
    figures = measure(args.kv_memory)
    print(json.dumps({"kv_memory": args.kv_memory, **{k: round(v, 3) for k, v in figures.items()}}, indent=2))


if __name__ == "__main__":
    main()
