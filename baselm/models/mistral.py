"""Mistral: Llama with a sliding attention window in every layer (when the config sets one)."""

from __future__ import annotations

from dataclasses import dataclass

from baselm.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama's config; `sliding_window`, when set, applies to every layer."""

    def resolve_layer_types(self) -> list[str]:
        kind = "sliding_attention" if self.sliding_window else "full_attention"
        return [kind] * self.num_hidden_layers


class Model(llama.Model):
    """Llama's decoder: the window is a config difference only."""
