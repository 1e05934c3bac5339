"""Entry point of both ranks in the tensor-parallel tests: `python -m tests.dist.tp_ranks TEST`.

Rank 0 starts rank 1, both build each fixture sharded over the pair, and rank 0 prints one JSON
line comparing what the pair computed with the whole model in rank 0 alone.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

import baselm  # noqa: F401  first: the BLAS before mlx.core
from baselm import cpu, dist
from baselm.dist.tp import Sharding
from baselm.models import build_model
from baselm.store import hf
from tests.forward import prefill_logits
from tests.paths import MODEL_FIXTURES

FIXTURES = sorted(p.name for p in MODEL_FIXTURES.iterdir() if (p / "config.json").exists())
PROMPT = [3, 17, 42, 99, 5, 200, 11, 64, 7, 128, 31]


def quantized(weights: dict[str, mx.array], group_size: int = 32, bits: int = 4) -> dict[str, mx.array]:
    """The fixture's projection weights as affine triplets (the layout `.base` and GGUF files load)."""
    out = {}
    for name, value in weights.items():
        if name.endswith("_proj.weight") and value.ndim == 2 and value.shape[-1] % group_size == 0:
            prefix = name.removesuffix(".weight")
            codes, scales, biases = mx.quantize(value, group_size, bits)
            out |= {f"{prefix}.weight": codes, f"{prefix}.scales": scales, f"{prefix}.biases": biases}
        else:
            out[name] = value
    return out


def _build(name: str, sharding: Sharding | None, quant: str | None):
    """A fixture, whole or sharded: float, or quantized through the CPU kernels ("kernels") or
    MLX's quantized layers ("reference")."""
    folder = MODEL_FIXTURES / name
    weights = hf.read_weights(folder)
    if quant:
        weights = quantized(weights)
    kernels = quant == "kernels" and cpu.available()
    return build_model(hf.read_config(folder), weights, keep_quantized=bool(quant), cpu_kernels=kernels, shard=sharding)


def logits(group: dist.DistGroup, quant: str | None) -> dict:
    """Prefill logits of every fixture: the pair against rank 0's whole model."""
    result = {}
    names = FIXTURES if not quant else ["llama", "qwen2", "mistral", "phi3", "smollm3"]
    for name in names:
        sharding = Sharding(group.rank, group.size, group.group)
        pair = prefill_logits(_build(name, sharding, quant), PROMPT)
        if group.rank == 0:
            whole = prefill_logits(_build(name, None, quant), PROMPT)
            result[name] = {
                "max_abs_diff": float(np.abs(pair - whole).max()),
                "same_argmax": bool((pair.argmax(-1) == whole.argmax(-1)).all()),
                "sharding": sharding.describe(),
            }
    return result


TESTS = {
    "logits": lambda g: logits(g, None),
    "quantized_logits": lambda g: {q: logits(g, q) for q in ("kernels", "reference")},
}


def main() -> None:
    name = sys.argv[1]
    group = dist.form([sys.executable, "-m", "tests.dist.tp_ranks", name], 2)
    result = TESTS[name](group)
    if group.rank == 0:
        print(json.dumps(result), flush=True)
        group.stop()


if __name__ == "__main__":
    main()
