"""`base bench --speculative`: each workload decoded with and without speculative decoding,
side by side in one process, on the same prompts, alternating runs (in ABBA order) and keeping
each one's best.

Workloads:
- grounded: answers that copy from the prompt (repeat, reformat or quote a passage), where
  an n-gram proposer finds most of what comes next;
- free: open-ended writing, where proposals are rarer and worse;
- random: random prompt tokens (as the throughput scenario).
Greedy decoding, so both engines must produce the same tokens (checked and reported).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from baselm.config import ConfigError, EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.sampling.params import SamplingParams
from baselm.speculative.policy import plan_drafts

WORKLOADS = ("grounded", "free", "random")

PASSAGES = (
    "The old mill stood at the bend of the river for two hundred years. Every spring the water rose and "
    "turned the great wheel faster, and the miller's family worked from dawn until the light failed. When "
    "the railway came to the valley, grain began to travel to the city instead, and one by one the mills "
    "along the river fell silent. Today the wheel still turns, slowly, for visitors who come on Sundays.",
    "To plant a tree, dig a hole twice as wide as the root ball and no deeper. Loosen the soil at the "
    "sides so the roots can spread. Set the tree straight, fill the hole halfway with soil, and water it "
    "well. Then fill the rest of the hole, press the soil down gently, and water again. Keep the ground "
    "moist for the first year, and do not pile mulch against the trunk.",
    "The committee met on Tuesday to review the budget for the new library. Members agreed that the "
    "reading room should open first, followed by the children's section in the autumn. The cost of the "
    "roof repairs was higher than expected, so the cafe will wait until next year. The committee thanked "
    "the volunteers who sorted more than ten thousand donated books during the summer.",
    "Light travels from the sun to the earth in a little over eight minutes. On the way it passes through "
    "the atmosphere, where air molecules scatter the shorter blue wavelengths more than the longer red "
    "ones. That is why the sky looks blue during the day. At sunset the light crosses much more air "
    "before it reaches us, the blue is scattered away, and the sky turns orange and red.",
)
GROUNDED_TASKS = (
    "Repeat the following passage exactly, word for word:",
    "Copy the passage below, putting each sentence on a line of its own:",
    "Quote the following text in full:",
    "Rewrite the passage below exactly as it is, then stop:",
)
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten-year-old.",
    "Describe a walk through a busy market early in the morning.",
    "Write a letter to a friend about a trip to the mountains.",
)


def workload_prompts(loaded: LoadedModel, workload: str, count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts (token ids) of a workload, through the chat template when the model has one."""
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    tokenizer = loaded.tokenizer
    if workload == "random":
        rng = np.random.default_rng(seed)
        return [
            rng.integers(100, min(loaded.model.args.vocab_size, 30000), prompt_tokens).tolist() for _ in range(count)
        ]
    texts = []
    for i in range(count):
        if workload == "grounded":
            texts.append(f"{GROUNDED_TASKS[i % 4]}\n\n{PASSAGES[(i + i // 4) % 4]}")
        else:
            texts.append(FREE_PROMPTS[i % 4])
    if not tokenizer.has_chat_template:
        return [tokenizer.encode(t) for t in texts]
    return [tokenizer.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


def decode_run(engine: LLMEngine, prompts: list[list[int]], gen_tokens: int) -> dict[str, Any]:
    """Runs the prompts together, greedy; decode speeds from each request's token times."""
    params = SamplingParams(temperature=0, max_tokens=gen_tokens)
    before = engine.spec_stats().to_json()
    added = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.token_ids)
            tokens[out.request_id] += out.token_ids
    per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in times.values() if len(t) > 1 and t[-1] > t[0]]
    first = max(t[0] for t in times.values())
    last = max(t[-1] for t in times.values())
    total = sum(len(t) - 1 for t in times.values())
    after = engine.spec_stats().to_json()
    drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "decode_tok_s_per_stream": round(float(np.median(per_stream)), 2) if per_stream else 0.0,
        "decode_tok_s_aggregate": round(total / (last - first), 2) if last > first else 0.0,
        "elapsed_s": round(time.perf_counter() - added, 2),
        "output_tokens": sum(len(t) for t in tokens.values()),
        "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
        "draft_tokens": drafts,
        "tokens": [tokens[rid] for rid in ids],
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: r["decode_tok_s_per_stream"])


def compare(loaded: LoadedModel, config: EngineConfig, spec: SpeculativeConfig, options: Any) -> dict[str, Any]:
    """Each workload at each concurrency, plain and speculative, best of `repeats` alternating runs."""
    plain = LLMEngine(loaded, replace(config, speculative=None))
    fast = LLMEngine(loaded, replace(config, speculative=spec))
    decode_run(plain, workload_prompts(loaded, "free", 1, 16, 0), 4)  # warm-up
    decode_run(fast, workload_prompts(loaded, "free", 1, 16, 0), 4)
    rows = []
    for workload in options.workloads:
        for concurrency in options.concurrency:
            prompts = workload_prompts(loaded, workload, concurrency, options.prompt_tokens, options.seed)
            plain_runs, spec_runs = [], []
            for i in range(
                options.spec_repeats
            ):  # plain first, then speculative first: a drift in load favours neither
                if i % 2 == 0:
                    plain_runs.append(decode_run(plain, prompts, options.gen_tokens))
                spec_runs.append(decode_run(fast, prompts, options.gen_tokens))
                if i % 2 == 1:
                    plain_runs.append(decode_run(plain, prompts, options.gen_tokens))
            off, on = _best(plain_runs), _best(spec_runs)
            row = _row(workload, concurrency, off, on)
            # Each speculative run over the plain run beside it: the spread on a shared machine.
            pairs = [
                b["decode_tok_s_aggregate"] / a["decode_tok_s_aggregate"] if a["decode_tok_s_aggregate"] else 0.0
                for a, b in zip(plain_runs, spec_runs)
            ]
            row["speedup_aggregate_pairs"] = [round(p, 3) for p in pairs]
            row.update(pair_summary(pairs))
            rows.append(row)
    report = {"speculative": spec.to_json(), "runs": rows}
    if fast.speculator is not None:
        cost = fast.speculator.cost
        report["step_ms_by_tokens"] = {str(k): round(v * 1000, 2) for k, v in cost.table().items()}
        intercept, slope = cost.line()
        report["step_line_ms"] = {"a": round(intercept * 1000, 2), "b_per_token": round(slope * 1000, 3)}
        report["auto_off_at_batch"] = {str(a): auto_off_batch(fast, a) for a in (0.5, 0.7, 0.9)}
        report["totals"] = fast.spec_stats().to_json()
    return report


def _row(workload: str, concurrency: int, off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float:
        return round(on[key] / off[key], 3) if off[key] else 0.0

    return {
        "workload": workload,
        "concurrency": concurrency,
        "plain_tok_s_per_stream": off["decode_tok_s_per_stream"],
        "spec_tok_s_per_stream": on["decode_tok_s_per_stream"],
        "speedup_per_stream": ratio("decode_tok_s_per_stream"),
        "plain_tok_s_aggregate": off["decode_tok_s_aggregate"],
        "spec_tok_s_aggregate": on["decode_tok_s_aggregate"],
        "speedup_aggregate": ratio("decode_tok_s_aggregate"),
        "acceptance_rate": on["acceptance_rate"],
        "draft_tokens": on["draft_tokens"],
        "output_tokens": on["output_tokens"],
        "same_tokens": on["tokens"] == off["tokens"],
    }


def pair_summary(ratios: list[float]) -> dict[str, Any]:
    """The median of the speculative/plain pair ratios and a 95% interval of their mean (normal,
    1.96 standard errors; from 2 pairs). Best-of runs compare two maxima, each at the mercy of one
    lucky run on a shared machine; the pairs' spread says how far a ratio can be trusted."""
    summary: dict[str, Any] = {"speedup_pairs_median": round(float(np.median(ratios)), 4) if ratios else 0.0}
    if len(ratios) >= 2:
        mean, half = float(np.mean(ratios)), 1.96 * float(np.std(ratios, ddof=1)) / len(ratios) ** 0.5
        summary["speedup_pairs_mean_ci95"] = [round(mean - half, 4), round(mean, 4), round(mean + half, 4)]
    return summary


def auto_off_batch(engine: LLMEngine, acceptance: float, most: int = 256) -> int | None:
    """The smallest batch of decoding requests, all accepting drafts at `acceptance`, for which the
    adaptive rule verifies no draft at all on this machine's measured step costs (None: not up to `most`)."""
    k = engine.config.speculative.num_speculative_tokens
    for batch in range(1, most + 1):
        if not any(plan_drafts([acceptance] * batch, [k] * batch, batch, engine.speculator.cost)):
            return batch
    return None


# Short words in two lines, values that wrap at spaces: the table fits 80 columns without a cut.
COLUMNS = (
    "workload",
    "streams",
    "per stream tok/s\noff / on (x)",
    "in total tok/s\noff / on (x)",
    "paired x\n(95% CI)",
    "accepted",
    "same\ntokens",
)


def render_rows(report: dict[str, Any]) -> list[list[str]]:
    """Table rows for `base bench`'s text output."""
    return [
        [
            r["workload"],
            str(r["concurrency"]),
            f"{r['plain_tok_s_per_stream']:.1f} / {r['spec_tok_s_per_stream']:.1f} ({r['speedup_per_stream']:.2f}x)",
            f"{r['plain_tok_s_aggregate']:.1f} / {r['spec_tok_s_aggregate']:.1f} ({r['speedup_aggregate']:.2f}x)",
            _interval(r),
            f"{r['acceptance_rate']:.0%}",
            "yes" if r["same_tokens"] else "NO",
        ]
        for r in report["runs"]
    ]


def _interval(row: dict[str, Any]) -> str:
    ci = row.get("speedup_pairs_mean_ci95")
    return f"{ci[1]:.3f} ± {(ci[2] - ci[0]) / 2:.3f}" if ci else "-"  # the interval is symmetric
