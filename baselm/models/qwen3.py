"""Qwen3: Qwen2's layout with RMS norms on each head's queries and keys, and no forced biases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baselm.models import llama, qwen2


@dataclass
class ModelArgs(qwen2.ModelArgs):
    """Qwen2's config (layer types, sliding window)."""


class Model(llama.Model):
    """Llama's decoder with q/k norms and the config's own biases."""

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        return {**super().attention_options(args, layer_idx), "qk_norm_eps": args.rms_norm_eps}
