"""Time to first token of a long prompt after `base serve` restarts on its prefix cache file, vs cold.

Starts `base serve MODEL --prefix-cache-file F` (F in a fresh temporary folder), sends one prompt of
about N tokens (greedy), stops the server with SIGTERM (it saves the cache as it exits), starts it
again on the same file, sends the same prompt, and prints both TTFTs, their ratio and whether the
answers are identical, as JSON.

    python scripts/bench_prefix_restart.py [MODEL] [--prompt-tokens 2000] [--device cpu]

MODEL defaults to SmolLM2-135M-Instruct (fetched once into the store's downloads).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import openai
from bench_http import ServerProcess, base_server, openai_client  # scripts/ is on the path when a script here runs

WORDS = "the ship sailed along the coast while gulls circled over the harbour and the old town".split()


def server(model: str, cache_file: Path, device: str) -> ServerProcess:
    return base_server(model, device, 1, ("--prefix-cache-file", str(cache_file)))


def ask(client: openai.OpenAI, prompt: str) -> dict:
    start = time.perf_counter()
    first, text, usage = None, "", None
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"ttft_s": first - start, "text": text, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from baselm.store.default_model import fetch_default_gguf

        model = str(fetch_default_gguf())
    # About 1.7 tokens a word with these words and numbers (SmolLM2's tokenizer).
    words = int(args.prompt_tokens / 1.7)
    prompt = " ".join(WORDS[i % len(WORDS)] + (f" {i}" if i % 7 == 0 else "") for i in range(words))
    with tempfile.TemporaryDirectory() as folder:
        cache_file = Path(folder) / "prefix.kvc"
        with server(model, cache_file, args.device) as first:
            ask(openai_client(first), "Hello")  # warm-up
            cold = ask(openai_client(first), prompt)
        with server(model, cache_file, args.device) as restarted:  # after SIGTERM: the cache file is saved
            warm = ask(openai_client(restarted), prompt)
        report = {
            "prompt_tokens": cold["prompt_tokens"],
            "cache_file_mib": round(cache_file.stat().st_size / 2**20, 1),
            "cold_ttft_ms": round(1000 * cold["ttft_s"], 1),
            "restarted_ttft_ms": round(1000 * warm["ttft_s"], 1),
            "restarted_cached_tokens": warm["cached_tokens"],
            "speedup": round(cold["ttft_s"] / warm["ttft_s"], 1),
            "same_answer": cold["text"] == warm["text"],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
