"""How much accuracy each way of coding the activations costs, on SmolLM2-135M-Instruct (its Q4_1 GGUF).

The exact path (float32 activations against the GGUF blocks) runs with every block matmul's input
rounded first, per block of 32 values with the block's own scale, the way a scheme's integer codes
would hold it:
  16-bit   codes up to 32767 (base's CPU default);
  8-bit    codes up to 127 (llama.cpp's Q8_0/Q8_K activations);
  mixed T  8-bit, but 16-bit for a block whose largest value is over T times its root mean square
           (the blocks an outlier coarsens), with the share of such blocks reported.
For each scheme it prints: how many of transformers' reference tokens (../shared/reference) each
case keeps before the first step whose top-2 margin is below 0.05 (the fast path's test), and over
the first 1024 tokens of each text, teacher-forced, how many positions change their greedy token
against the exact path, how many of those had a top-2 margin of at least 0.05 (and the largest), and
the mean absolute change of the logits.

    python scripts/activation_codes_accuracy.py TEXT [TEXT ...] [--mixed 4,3,2.5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["BASE_CPU_LAYER"] = "0"  # every matmul through the per-op path, where its input is rounded

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import baselm.models.linear as linear  # noqa: E402
from baselm import cpu  # noqa: E402
from baselm.backend import select_backend  # noqa: E402
from baselm.config import EngineConfig  # noqa: E402
from baselm.engine import LLMEngine  # noqa: E402
from baselm.loader import load_model  # noqa: E402
from baselm.metal import AttentionMetadata  # noqa: E402
from baselm.perplexity import make_cache  # noqa: E402
from baselm.sampling.params import SamplingParams  # noqa: E402
from baselm.store.default_model import fetch_default_gguf  # noqa: E402

REFERENCE = REPO.parent / "shared" / "reference" / "smollm2_transformers_greedy.json"
NEAR_TIE = 0.05
MAX_TOKENS = 1024


class Rounding:
    """The scheme the block matmuls' inputs are rounded to: None (exact), 16, 8 or ("mixed", T)."""

    def __init__(self) -> None:
        self.scheme = None
        self.blocks = self.wide = 0

    def __call__(self, x: mx.array) -> mx.array:
        if self.scheme is None:
            return x
        blocks = x.reshape(-1, x.shape[-1] // 32, 32).astype(mx.float32)  # (rows, K / 32, 32)
        largest = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
        if isinstance(self.scheme, tuple):
            rms = mx.sqrt(mx.mean(blocks * blocks, axis=-1, keepdims=True))
            wide = largest > self.scheme[1] * rms
            self.blocks += wide.size
            self.wide += int(mx.sum(wide).item())
            top = mx.where(wide, 32767.0, 127.0)
        else:
            top = 32767.0 if self.scheme == 16 else 127.0
        step = mx.where(largest > 0, largest / top, 1.0)
        return (mx.round(blocks / step) * step).reshape(x.shape).astype(x.dtype)


def greedy(loaded, prompt: list[int], num_tokens: int) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig(kv_memory=64 * 2**20))
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].completions[0].token_ids


def all_logits(model, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of one forward over `ids`."""
    cache = make_cache(model, len(ids))
    table = list(range(-(-len(ids) // cache.block_size)))
    rows = list(range(len(ids)))
    meta = AttentionMetadata.build([table], [len(ids)], [len(ids)], cache.block_size, logits_indices=rows)
    return np.array(model(mx.array(ids, dtype=mx.int32), meta.positions, meta, cache).astype(mx.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", type=Path)
    parser.add_argument("--mixed", default="4,3,2.5", help="thresholds T of the mixed schemes")
    args = parser.parse_args()

    cpu.kernels.set_exact(True)  # float32 activations: the rounding below is the only one
    loaded = load_model(str(fetch_default_gguf()), select_backend("cpu"))
    rounding = Rounding()
    block_linear = linear._block_linear
    linear._block_linear = lambda x, blocks, kind, bias: block_linear(rounding(x), blocks, kind, bias)
    cases = json.loads(REFERENCE.read_text())["cases"]
    texts = [loaded.tokenizer.encode(p.read_text(), add_special_tokens=True)[:MAX_TOKENS] for p in args.texts]
    exact = [all_logits(loaded.model, ids) for ids in texts]

    schemes = [("16-bit", 16), ("8-bit", 8)] + [(f"mixed T={t}", ("mixed", float(t))) for t in args.mixed.split(",")]
    for name, scheme in schemes:
        rounding.scheme, rounding.blocks, rounding.wide = scheme, 0, 0
        kept = []
        for case in cases:
            margins = case["top2_margin"]
            steps = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
            want = case["generated_token_ids"][:steps]
            got = greedy(loaded, case["prompt_token_ids"], len(want))
            kept.append(f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))}/{len(want)}")
        changed = clear = 0
        largest, diffs = 0.0, []
        for ids, want in zip(texts, exact):
            got = all_logits(loaded.model, ids)
            top2 = np.sort(want, axis=-1)[:, -2:]
            margin = top2[:, 1] - top2[:, 0]
            moved = np.argmax(got, -1) != np.argmax(want, -1)
            changed += int(moved.sum())
            clear += int((moved & (margin >= NEAR_TIE)).sum())
            largest = max([largest, *margin[moved & (margin >= NEAR_TIE)].tolist()])
            diffs.append(float(np.abs(got - want).mean()))
        wide = f", 16-bit blocks {rounding.wide / rounding.blocks:.0%}" if rounding.blocks else ""
        print(
            f"{name:12s} reference kept {' '.join(kept)} | {sum(map(len, texts))} positions: {changed} changed, "
            f"{clear} with margin >= {NEAR_TIE} (largest {largest:.3f}) | mean |dlogit| {np.mean(diffs):.4f}{wide}",
            flush=True,
        )


if __name__ == "__main__":
    main()
