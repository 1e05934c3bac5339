"""Mixtral: Mistral attention with a top-k routed mixture of SwiGLU experts in every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from baselm.models import llama, mistral
from baselm.models.moe import SparseMoE, split_fused_experts, stack_experts

# Mixtral's expert projection names -> the shared SwitchGLU's.
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class ModelArgs(mistral.ModelArgs):
    """Mistral's config plus the expert count and experts per token."""

    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    default_rope_theta: ClassVar[float] = 1_000_000.0


class Model(llama.Model):
    """Llama's decoder with a SparseMoE in place of every MLP."""

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        # Mixtral always renormalizes the top-k router probabilities.
        return SparseMoE(
            args.hidden_size,
            args.intermediate_size,
            args.num_local_experts,
            args.num_experts_per_tok,
            norm_topk_prob=True,
            act=args.hidden_act,
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in super().sanitize(weights).items()}
        for i in range(self.args.num_hidden_layers):
            split_fused_experts(weights, f"layers.{i}.mlp")
            stack_experts(weights, f"layers.{i}.mlp", self.args.num_local_experts, _EXPERT_NAMES)
        return weights
