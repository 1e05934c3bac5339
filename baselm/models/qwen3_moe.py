"""Qwen3-MoE: Qwen3 attention with top-k routed expert MLPs (dense MLPs in `mlp_only_layers`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from baselm.models import qwen3
from baselm.models.base import ModelConfigError
from baselm.models.mlp import MLP
from baselm.models.moe import SparseMoE, split_fused_experts, stack_experts


@dataclass
class ModelArgs(qwen3.ModelArgs):
    """Qwen3's config plus the experts and which layers have them."""

    # Hub configs say `num_experts`; newer transformers write `num_local_experts`.
    num_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts is None:
            self.num_experts = self.num_local_experts if self.num_local_experts is not None else 128

    def resolve_layer_types(self) -> list[str]:
        """As HF: with `use_sliding_window`, every layer slides (no `max_window_layers` here)."""
        is_sliding = self.use_sliding_window and self.sliding_window
        return ["sliding_attention" if is_sliding else "full_attention"] * self.num_hidden_layers

    def validate(self) -> None:
        if self.decoder_sparse_step < 1:
            raise ModelConfigError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")
        super().validate()

    def is_sparse(self, layer_idx: int) -> bool:
        """As HF: experts in every `decoder_sparse_step`-th layer that is not in `mlp_only_layers`."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Model(qwen3.Model):
    """Qwen3's decoder with a SparseMoE in the sparse layers, a dense MLP elsewhere."""

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        if not args.is_sparse(layer_idx):
            return MLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        return SparseMoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            args.hidden_act,
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        names = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                split_fused_experts(weights, f"layers.{i}.mlp")
                stack_experts(weights, f"layers.{i}.mlp", self.args.num_experts, names)
        return weights
