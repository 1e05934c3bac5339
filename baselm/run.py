"""`base run`: one prompt, one answer, through the engine, streamed or as one JSON object."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from baselm.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from baselm.chat.stats import TurnStats


def _timings_json(load_s: float, stats: TurnStats) -> dict[str, float]:
    """The `timings` object of `base run --json`, from the turn's numbers (baselm.chat.stats.TurnStats)."""
    return {
        "load_s": round(load_s, 3),
        "ttft_s": round(stats.ttft_s, 4),
        "total_s": round(stats.total_s, 4),
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 1),
    }


def prompt_ids(tokenizer, prompt: str, raw: bool) -> list[int]:
    """The prompt as token ids: through the chat template unless `raw` or the model has none."""
    if raw or not tokenizer.has_chat_template:
        return tokenizer.encode(prompt)
    return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)


def _logprobs_json(tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def token(i: int) -> dict[str, Any]:
        return {"token_id": i, "token": tokenizer.decode([i])}

    return [
        {**token(e.token_id), "logprob": e.logprob, "top_logprobs": [{**token(i), "logprob": lp} for i, lp in e.top]}
        for e in entries
    ]


def run_once(
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
    logprobs: int | None,
    as_json: bool,
    device: str,
) -> None:
    from baselm.backend import select_backend
    from baselm.chat.stats import TurnStats
    from baselm.config import EngineConfig
    from baselm.engine import LLMEngine
    from baselm.loader import load_model

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs
    )
    start = time.perf_counter()
    loaded = load_model(model, select_backend(device))
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1))
    ids = prompt_ids(loaded.tokenizer, prompt, raw)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    text, token_ids, entries, finish_reason, ttft = "", [], [], None, None
    for out in engine.stream(ids, params):
        ttft = ttft if ttft is not None else time.perf_counter() - start
        text += out.text
        token_ids += out.token_ids
        entries += out.logprobs
        finish_reason = out.finish_reason
        if not as_json and out.text:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    stats = TurnStats(
        num_prompt_tokens=len(ids),
        num_output_tokens=len(token_ids),
        ttft_s=ttft or 0.0,
        total_s=time.perf_counter() - start,
        finish_reason=finish_reason,
    )
    timings = _timings_json(load_s, stats)
    if as_json:
        result = {
            "model": loaded.name,
            "text": text,
            "prompt_token_ids": ids,
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            "logprobs": _logprobs_json(loaded.tokenizer, entries) if logprobs is not None else None,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(token_ids),
                "total_tokens": len(ids) + len(token_ids),
            },
            "timings": timings,
        }
        print(json.dumps(result, ensure_ascii=False))
        return
    t = timings
    sys.stdout.write("\n")
    print(
        f"\n[{len(ids)} prompt tokens at {t['prefill_tokens_per_s']} tok/s, {len(token_ids)} generated at "
        f"{t['decode_tokens_per_s']} tok/s, finish: {finish_reason}]",
        file=sys.stderr,
    )
