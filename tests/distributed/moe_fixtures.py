"""MoE fixtures whose experts split over two ranks in both ways, also quantized in groups of 32.

The fixtures' experts have 32 intermediate features: one quantization group, which an
intermediate split over two ranks cannot cut. Widened to 64 (seeded random values), each rank
takes one group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.store import hf

# fixture -> the config key of its experts' intermediate size
WIDENED_EXPERTS = {"mixtral": "intermediate_size", "qwen3_moe_sparse": "moe_intermediate_size"}


def widened_experts(folder: Path, key: str) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(config, weights) of the fixture in `folder` with 64 intermediate features per expert."""
    rng = np.random.default_rng(0)
    weights = hf.read_weights(folder)
    for name, value in sorted(weights.items()):
        if ".experts." in name:
            shape = tuple(64 if n == 32 else n for n in value.shape)
            weights[name] = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)
    return {**hf.read_config(folder), key: 64}, weights
