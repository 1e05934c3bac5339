"""MoE under tensor parallelism: whole experts per rank against every expert sliced, side by side.

    python scripts/bench_moe_split.py DIR [--repeats 3] [--concurrency 1,4] [--device cpu]

Writes a Mixtral-shaped model with seeded random float32 weights to DIR (once), then runs
`base bench DIR --tensor-parallel 2 --moe-split S --json` for S = intermediate, experts in
turn, `--repeats` rounds (alternating, so load from other processes on a shared machine falls
on both), and prints each run, the best of each, their ratios, the all-reduce bytes per token
and each rank's weight bytes. The raw reports go to DIR/runs.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer, models

import baselm  # noqa: F401  first: the BLAS before mlx.core

# Mixtral's layout at a size two CPU cores decode in milliseconds per token:
# the experts are 90% of the weights, so the MoE split decides the step time.
CONFIG = {
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
SPLITS = ("intermediate", "experts")


def write_model(folder: Path, seed: int = 0) -> None:
    """The Mixtral-shaped HF folder: config.json, model.safetensors (per-expert tensors), a word-level tokenizer."""
    c = CONFIG
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        shapes |= {f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h)}
        shapes |= {f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q)}
        shapes[f"{p}.block_sparse_moe.gate.weight"] = (c["num_local_experts"], h)
        for e in range(c["num_local_experts"]):
            x = f"{p}.block_sparse_moe.experts.{e}"
            shapes |= {f"{x}.w1.weight": (inter, h), f"{x}.w3.weight": (inter, h), f"{x}.w2.weight": (h, inter)}
    weights = {
        name: 0.02 * mx.random.normal(shape, key=mx.random.key(seed * 1_000_003 + i))
        for i, (name, shape) in enumerate(shapes.items())
    }
    for i in range(c["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = mx.ones((h,))
    weights["model.norm.weight"] = mx.ones((h,))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(c))
    vocab = {f"t{i}": i for i in range(c["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


def run_bench(folder: Path, split: str, args: argparse.Namespace) -> dict:
    command = [
        *(sys.executable, "-m", "baselm.cli", "bench", str(folder), "--json", "--device", args.device),
        *("--tensor-parallel", "2", "--moe-split", split, "--concurrency", args.concurrency),
        *("--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)),
    ]
    print("$", " ".join(command[2:]), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def summary(report: dict) -> dict:
    dist = report["distributed"]
    row = {
        "all_reduce_bytes_per_token": dist["all_reduce_bytes_per_token"],
        "weight_bytes_rank0": dist["sharding"]["weight_bytes"],
    }
    for t in report["throughput"]:
        c = t["concurrency"]
        row |= {f"c{c}_decode_tok_s": t["decode_tok_s_aggregate"], f"c{c}_prefill_tok_s": t["prefill_tok_s"]}
    return row


def layer_times(folder: Path, num_tokens: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Milliseconds of one MoE layer's part on the slower of the two ranks, in one process: each
    rank's part of layer 0 (built as that rank builds it) timed alone on the same tokens (best of
    3), the splits alternated; the mean over `repeats` draws of random tokens, so that how the
    router spreads them over the ranks varies as in a real run. Without the processes' meetings,
    this is the compute each split leaves a rank, imbalance included (a step waits for the slower)."""
    from baselm.store import hf

    config = {**json.loads((folder / "config.json").read_text()), "num_hidden_layers": 1}
    weights = {k: v for k, v in hf.read_weights(folder).items() if ".layers." not in k or ".layers.0." in k}
    parts = {split: [_rank_part(config, weights, r, split) for r in (0, 1)] for split in SPLITS}
    mean: dict[str, dict[int, float]] = {s: {} for s in SPLITS}
    for n in num_tokens:
        for draw in range(repeats):
            x = mx.random.normal((n, config["hidden_size"]), key=mx.random.key(1000 * n + draw))  # (num_tokens, hidden)
            for split in SPLITS:
                slowest = max(min(_timed(part, x) for _ in range(3)) for part in parts[split])
                mean[split][n] = mean[split].get(n, 0.0) + slowest / repeats
    return mean


def _rank_part(config: dict, weights: dict, rank: int, split: str):
    """Rank `rank`'s part of layer 0's MoE, as that rank builds it (before the all_sum)."""
    from baselm.distributed.tp.layers import Sharding
    from baselm.models import build_model

    return build_model(config, dict(weights), shard=Sharding(rank, 2, moe_split=split)).layers[0].mlp.inner


def _timed(part, x: mx.array) -> float:
    mx.eval(part(x))  # warm
    start = time.perf_counter()
    mx.eval(part(x))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layer-tokens", default="1,4,128,512", help="tokens of the one-process layer timing")
    args = parser.parse_args()
    if not (args.folder / "config.json").exists():
        write_model(args.folder)
    tokens = [int(n) for n in args.layer_tokens.split(",") if n]
    if tokens:
        mean = layer_times(args.folder, tokens, args.repeats * 4)
        print(f"one MoE layer, the slower rank's part, ms (mean of {args.repeats * 4} draws):", json.dumps(mean))
        ratios = {n: round(mean["experts"][n] / mean["intermediate"][n], 3) for n in tokens}
        print("experts / intermediate time:", ratios)
    runs: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for _ in range(args.repeats):
        for split in SPLITS:
            report = run_bench(args.folder, split, args)
            runs[split].append(report)
            print(split, json.dumps(summary(report)), flush=True)
    (args.folder / "runs.json").write_text(json.dumps(runs))
    best = {s: {k: max(summary(r)[k] for r in reports) for k in summary(reports[0])} for s, reports in runs.items()}
    print("best of", args.repeats, json.dumps(best, indent=1))
    ratios = {k: round(best["experts"][k] / best["intermediate"][k], 3) for k in best["experts"]}
    print("experts / intermediate:", json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
