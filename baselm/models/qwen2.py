"""Qwen2: Llama with biases on the q/k/v projections (not on o) and optional sliding layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baselm.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama's config plus Qwen2's switches for sliding-window layers."""

    use_sliding_window: bool = False
    max_window_layers: int = 28

    def resolve_layer_types(self) -> list[str]:
        """As HF: a sliding window only with `use_sliding_window`, in layers from `max_window_layers` on."""
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is not None and self.sliding_window:
            return list(self.layer_types)
        return [
            "sliding_attention" if self.sliding_window and i >= self.max_window_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        ]


class Model(llama.Model):
    """Llama's decoder with q/k/v biases."""

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False}
