"""`base run`: one prompt, one answer, through the engine, streamed or as one JSON object. Without a
prompt, the chat `base chat MODEL` opens (`chat_instead`), as `ollama run` does."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from baselm.chat.answer import Answer
from baselm.chat.settings import ChatOptions, chat_prefix_cache_file
from baselm.chat.stats import TurnStats
from baselm.commands.chat import ChatArgs
from baselm.commands.model import ModelArgs, is_follower, open_model, run_follower, warn_without_cpu_kernels
from baselm.commands.options import GenerationOptions, with_prefix_cache_file
from baselm.config import DEFAULT_RUNAWAY_GUARD, EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.outputs import quiet_runaway_log
from baselm.sampling.defaults import GenerationDefaults
from baselm.sampling.params import SamplingParams, TokenLogprobs
from baselm.speculative.speculator import SpecStats
from baselm.tokenizer.tokenizer import Tokenizer

# The closing line's note on an answer the runaway guard cut.
REPEATING = ", it kept repeating itself (--runaway-guard 0 lets it run)"


@dataclass(frozen=True, slots=True)
class RunArgs:
    """What `base run` does: which model where, the prompt, how to sample and how to print.
    Validated where it is made: the generation options check their own ranges, the seed and logprobs here.

    The answer samples as `base serve` answers a request that leaves sampling out: the command
    line's values, then the model's own, then llama.cpp's (baselm/sampling/defaults.py); `--seed`
    makes it reproducible, `--temperature 0` greedy."""

    model: ModelArgs
    prompt: str
    generation: GenerationOptions  # its seed is this request's
    logprobs: int | None = None  # the chosen token's and the top K alternatives' log-probabilities
    raw: bool = False  # the prompt as plain text, not through the chat template
    as_json: bool = False  # one JSON object at the end instead of streamed text
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        SamplingParams(seed=self.generation.seed, logprobs=self.logprobs)  # raises SamplingParamsError naming it


def chat_instead(model: ModelArgs, generation: GenerationOptions, speculative: SpeculativeConfig | None) -> ChatArgs:
    """`base run MODEL` without a prompt: the chat `base chat MODEL` opens (its prefix cache file
    too), with the generation options given."""
    prefix_file = chat_prefix_cache_file("auto", model.ref)
    config = EngineConfig(max_num_seqs=1, prefix_cache_file=prefix_file, speculative=speculative)
    model = replace(model, dist=with_prefix_cache_file(model.dist, prefix_file))
    return ChatArgs(model, ChatOptions(config), generation)


def run_once(options: RunArgs) -> None:
    """Loads the model, generates one answer to the prompt and prints it with its speed. A rank
    other than 0 of a tensor-parallel group follows rank 0 instead, and ends the process with it."""
    start = time.perf_counter()
    warn_without_cpu_kernels(options.model.device)
    loaded, group = open_model(options.model)
    if is_follower(group):
        raise SystemExit(run_follower(loaded, group, options.model.dist))
    loaded.check_writes_text()
    ids = prompt_ids(loaded.tokenizer, options.prompt, options.raw)
    params = sampling_params(options, loaded)
    config = one_request_config(len(ids), params.max_tokens, options.speculative, options.generation.runaway_guard)
    engine = LLMEngine(loaded, config)
    load_s = time.perf_counter() - start
    with quiet_runaway_log():  # said in the closing line instead of inside the streamed text
        answer = _generate(engine, ids, params, echo=not options.as_json)
    timings = _timings_json(load_s, answer.stats, engine.spec_stats() if engine.speculator is not None else None)
    if options.as_json:
        with_logprobs = params.logprobs is not None
        print(json.dumps(_result_json(loaded, ids, answer, timings, with_logprobs), ensure_ascii=False))
        return
    sys.stdout.write("\n")
    print(
        f"\n[{len(ids)} prompt tokens at {timings['prefill_tokens_per_s']} tok/s, {len(answer.token_ids)} generated "
        f"at {timings['decode_tokens_per_s']} tok/s, finish: {answer.stats.finish_reason}"
        f"{REPEATING * answer.stats.repeating}]",
        file=sys.stderr,
    )


def sampling_params(options: RunArgs, loaded: LoadedModel) -> SamplingParams:
    """The one request's SamplingParams: the seed and logprobs asked for, the rest from the generation defaults."""
    generation = GenerationDefaults.for_model(options.generation.sampling, loaded.config, loaded.max_model_len)
    return SamplingParams(**generation.fill({"seed": options.generation.seed, "logprobs": options.logprobs}))


def one_request_config(
    num_prompt_tokens: int,
    max_tokens: int | None,
    speculative: SpeculativeConfig | None = None,
    runaway_guard: int = DEFAULT_RUNAWAY_GUARD,
) -> EngineConfig:
    """An engine for this one request: its KV pool holds the prompt and `max_tokens` more (in
    whole blocks), not a full context; with no `max_tokens`, the model's whole context."""
    config = EngineConfig(max_num_seqs=1, speculative=speculative, runaway_guard=runaway_guard)
    if max_tokens is None:
        return config
    config.max_model_len = -(-(num_prompt_tokens + max_tokens) // config.block_size) * config.block_size
    return config


def prompt_ids(tokenizer: Tokenizer, prompt: str, raw: bool) -> list[int]:
    """The prompt as token ids: through the chat template unless `raw` or the model has none."""
    if raw or not tokenizer.has_chat_template:
        return tokenizer.encode(prompt)
    return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)


def _generate(engine: LLMEngine, ids: list[int], params: SamplingParams, echo: bool) -> Answer:
    """Runs the request to its end; with `echo` the text goes to stdout as it comes."""
    answer = Answer(stats=TurnStats(num_prompt_tokens=len(ids)))
    start = time.perf_counter()
    for out in engine.stream(ids, params):
        answer.add(out, time.perf_counter() - start)
        if echo and out.text:
            sys.stdout.write(out.text)
            sys.stdout.flush()
    answer.stats.total_s = time.perf_counter() - start
    return answer


def _result_json(
    loaded: LoadedModel, ids: list[int], answer: Answer, timings: dict[str, float], with_logprobs: bool
) -> dict[str, Any]:
    """The object `base run --json` prints."""
    return {
        "model": loaded.name,
        "text": answer.text,
        "prompt_token_ids": ids,
        "token_ids": answer.token_ids,
        "finish_reason": answer.stats.finish_reason,
        "logprobs": _logprobs_json(loaded.tokenizer, answer.logprobs) if with_logprobs else None,
        "usage": {
            "prompt_tokens": len(ids),
            "completion_tokens": len(answer.token_ids),
            "total_tokens": len(ids) + len(answer.token_ids),
        },
        "timings": timings,
    }


def _timings_json(load_s: float, stats: TurnStats, spec: SpecStats | None = None) -> dict[str, float]:
    """The `timings` object of `base run --json`, from the turn's numbers; with speculative
    decoding also its acceptance and the tokens each verifying step emitted."""
    timings = {
        "load_s": round(load_s, 3),
        "ttft_s": round(stats.ttft_s, 4),
        "total_s": round(stats.total_s, 4),
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 1),
    }
    if spec is not None:
        timings["spec_draft_tokens"] = stats.num_draft_tokens
        timings["spec_accepted_tokens"] = stats.num_accepted_tokens
        timings["spec_acceptance_rate"] = round(stats.acceptance_rate, 4)
        timings["spec_accepted_tokens_per_step"] = round(spec.accepted_tokens_per_step, 3)
    return timings


def _logprobs_json(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    def token(i: int) -> dict[str, Any]:
        return {"token_id": i, "token": tokenizer.decode([i])}

    return [
        {**token(e.token_id), "logprob": e.logprob, "top_logprobs": [{**token(i), "logprob": lp} for i, lp in e.top]}
        for e in entries
    ]
