"""Throughput of concurrent streams through `base serve`, measured with the openai client.

Starts `base serve MODEL` on a free loopback port, sends N streaming chat requests at once
(greedy, a fixed number of tokens each, ignore_eos), then the same one stream alone, and
prints aggregate and per-stream decode tokens/s and time to first token as JSON.

    python scripts/bench_http.py [MODEL] [--concurrency 8] [--max-tokens 64] [--device cpu]
    python scripts/bench_http.py [MODEL] --shared-prefix 400 [--concurrency 8] [--max-tokens 32]

With --shared-prefix N it instead sends one cold wave of concurrent requests whose system prompt
(about N tokens) is the same and whose questions differ, and prints their mean time to first token
and the prompt tokens the server found cached.

MODEL defaults to SmolLM2-135M-Instruct (fetched once into the store's downloads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for its tests.tools
from tests.tools.http_streams import ServerProcess, StreamTiming, free_port, summarize  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms.",
    "List some uses of copper.",
    "Describe a walk through a forest in autumn.",
    "What makes a good cup of tea?",
    "Tell me about the history of bicycles.",
    "How do bees make honey?",
    "Describe the night sky in winter.",
]


def stream_one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> StreamTiming:
    start = time.perf_counter()
    first = last = usage = None
    finish_reason = ""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.choices and chunk.choices[0].finish_reason:
            last, finish_reason = time.perf_counter(), chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
    return StreamTiming(start, first, last, usage.prompt_tokens, usage.completion_tokens, finish_reason)


SYSTEM_WORDS = "you are a careful assistant who answers questions about ships harbours and the sea".split()


def stream_chat(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(
        model="bench",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {"ttft": first - start, "prompt": usage.prompt_tokens, "cached": details.cached_tokens if details else 0}


def shared_prefix_wave(client: openai.OpenAI, concurrency: int, prefix_tokens: int, max_tokens: int) -> dict:
    """One cold wave: `concurrency` requests at once with the same ~prefix_tokens system prompt."""
    words = int(prefix_tokens / 1.25)  # about 1.25 tokens a word here (SmolLM2's tokenizer)
    system = " ".join(f"{SYSTEM_WORDS[i % len(SYSTEM_WORDS)]}" + (f" {i}" if i % 9 == 0 else "") for i in range(words))
    questions = [f"Question {i}: " + " ".join(PROMPTS[i % len(PROMPTS)].split() * 3) for i in range(concurrency)]
    waves = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: stream_chat(client, m, max_tokens), waves))
    return {
        "concurrency": concurrency,
        "prompt_tokens_mean": round(statistics.fmean(r["prompt"] for r in results), 1),
        "cached_tokens_mean": round(statistics.fmean(r["cached"] for r in results), 1),
        "ttft_mean_ms": round(1000 * statistics.fmean(r["ttft"] for r in results), 1),
        "ttft_max_ms": round(1000 * max(r["ttft"] for r in results), 1),
    }


def run(client: openai.OpenAI, model: str, concurrency: int, max_tokens: int) -> dict:
    with ThreadPoolExecutor(concurrency) as pool:
        streams = list(pool.map(lambda p: stream_one(client, model, p, max_tokens), (PROMPTS * 4)[:concurrency]))
    return summarize(streams)


def base_server(model: str, device: str, concurrency: int, extra: tuple[str, ...] = ()) -> ServerProcess:
    """`base serve MODEL` (served as "bench", with `extra` options) on a free loopback port: a context
    manager that waits until it answers and stops it at the end."""
    port = free_port()
    command = [sys.executable, "-m", "baselm.cli", "serve", model, "--port", str(port), "--device", device]
    command += ["--max-num-seqs", str(max(concurrency, 1)), "--served-model-name", "bench", *extra]
    return ServerProcess("base serve", command, port, timeout_s=120, stop_timeout_s=120)


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--shared-prefix", type=int, default=0, help="Time one cold wave sharing N prompt tokens.")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from baselm.store.default_model import fetch_default_gguf

        model = str(fetch_default_gguf())
    with base_server(model, args.device, args.concurrency) as server:
        client = openai_client(server)
        run(client, "bench", 1, 4)  # warm-up
        if args.shared_prefix:
            print(
                json.dumps(shared_prefix_wave(client, args.concurrency, args.shared_prefix, args.max_tokens), indent=2)
            )
            return
        report = {
            "single": run(client, "bench", 1, args.max_tokens),
            "concurrent": run(client, "bench", args.concurrency, args.max_tokens),
        }
        report["speedup"] = round(report["concurrent"]["decode_tok_s"] / report["single"]["decode_tok_s"], 2)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
