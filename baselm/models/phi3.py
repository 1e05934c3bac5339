"""Phi-3: Llama with fused qkv and gate/up projections (split at load), LongRoPE scaling, and a
sliding window in every layer when the config sets one."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from baselm import gguf_blocks
from baselm.models import llama, mistral


@dataclass
class ModelArgs(mistral.ModelArgs):
    """Mistral's config (a window in every layer when set); LongRoPE comes through the rope dict."""


def _split_rows(weights: dict[str, mx.array], fused: str, parts: dict[str, int]) -> None:
    """Splits `{fused}.*` along its output rows into `parts` (name -> row count), in place.

    Rows are whole output features, so a quantized triplet's codes, scales and biases split alike,
    as do the rows of GGUF blocks.
    """
    prefix = fused.rsplit(".", 1)[0]
    for suffix in ("weight", "scales", "biases", "bias", *gguf_blocks.BY_SUFFIX):
        value = weights.pop(f"{fused}.{suffix}", None)
        if value is None:
            continue
        start = 0
        for name, num_rows in parts.items():
            weights[f"{prefix}.{name}.{suffix}"] = value[start : start + num_rows]
            start += num_rows


class Model(llama.Model):
    """Llama's decoder; the fused checkpoint projections are split at load."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        a = self.args
        q_rows, kv_rows = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        for i in range(a.num_hidden_layers):
            attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            _split_rows(weights, f"{attn}.qkv_proj", {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
            halves = {"gate_proj": a.intermediate_size, "up_proj": a.intermediate_size}
            _split_rows(weights, f"{mlp}.gate_up_proj", halves)
        return weights
