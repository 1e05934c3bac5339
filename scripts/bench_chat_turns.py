"""Time to first token per chat turn, with the prefix cache on and off.

Builds a conversation the way `base chat` does (`baselm.chat.conversation.Conversation`: each prompt
extends the previous turn's ids) and feeds every turn's prompt to two engines, one with
prefix caching and one without. With the cache, only the new message is prefilled, so
TTFT should stay flat as the conversation grows; without it, TTFT grows with the prompt.

    python scripts/bench_chat_turns.py [MODEL] [--turns 10] [--max-tokens 32] [--device cpu]

MODEL defaults to SmolLM2-135M-Instruct (fetched once into the store's downloads).
"""

from __future__ import annotations

import argparse
import time

from baselm.backend import select_backend
from baselm.chat.conversation import Conversation
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Tell me one fact about its history.",
    "What river runs through it?",
    "Name a famous museum there.",
    "What can I see in that museum?",
    "Which painting is the most famous?",
    "Who painted it?",
    "When did that painter live?",
    "Name another work by the same painter.",
    "Summarize our conversation in one sentence.",
]


def timed_turn(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> tuple[float, int, list[int], str]:
    """(TTFT seconds, cached prompt tokens, generated ids, text) of one request run alone."""
    start = time.perf_counter()
    ttft, cached, ids, text = 0.0, 0, [], ""
    for out in engine.stream(prompt_ids, params):
        if out.token_ids and not ids:
            ttft = time.perf_counter() - start
        ids += out.token_ids
        text += out.text
        cached = out.num_cached_tokens
    return ttft, cached, ids, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.model is None:
        from baselm.store.default_model import fetch_default_gguf

        args.model = str(fetch_default_gguf())
    loaded = load_model(args.model, select_backend(args.device))
    cached_engine = LLMEngine(loaded, EngineConfig(kv_memory=256 * 2**20, max_num_seqs=1))
    plain_engine = LLMEngine(loaded, EngineConfig(kv_memory=256 * 2**20, max_num_seqs=1, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    timed_turn(cached_engine, loaded.tokenizer.encode("warm up"), SamplingParams(max_tokens=2))
    timed_turn(plain_engine, loaded.tokenizer.encode("warm up"), SamplingParams(max_tokens=2))
    conversation = Conversation(loaded.tokenizer)
    eos = set(loaded.eos_token_ids)
    print(f"{'turn':>4} {'prompt':>6} {'reused':>6} {'cached':>6} {'TTFT cache on':>14} {'TTFT cache off':>15}")
    for turn, question in enumerate((QUESTIONS * 2)[: args.turns], start=1):
        prompt = conversation.next_prompt(question)
        ttft_on, cached, ids, text = timed_turn(cached_engine, prompt.token_ids, params)
        ttft_off, _, _, _ = timed_turn(plain_engine, prompt.token_ids, params)
        answer_ids = ids[:-1] if ids and ids[-1] in eos else ids
        conversation.add_turn(prompt, question, text, answer_ids)
        print(
            f"{turn:>4} {len(prompt.token_ids):>6} {prompt.num_reused_ids:>6} {cached:>6} "
            f"{ttft_on * 1000:>11.0f} ms {ttft_off * 1000:>12.0f} ms"
        )


if __name__ == "__main__":
    main()
