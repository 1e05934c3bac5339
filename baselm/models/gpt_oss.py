"""gpt-oss: a Llama-like decoder with attention sinks, sliding-window layers alternating with full
ones, YaRN RoPE, and in every layer a routed mixture of experts with biases and a clamped SwiGLU.

Checkpoints store the experts stacked and fused: `gate_up_proj` (num_experts, hidden, 2 * inter)
with gate and up interleaved along the last axis, `down_proj` (num_experts, inter, hidden), and
biases beside them. Released checkpoints store those weights in MXFP4 as `*_blocks`
(num_experts, out, in / 32, 16) uint8, two FP4 codes a byte, low nibble first, and `*_scales`
(num_experts, out, in / 32) uint8 exponents: MLX's "mxfp4" layout byte for byte, so they load
without rounding (kept quantized on GPUs, widened exactly to float on the CPU). MLX folders
(mlx-lm's layout) hold the experts split instead: `gate_proj`/`up_proj`/`down_proj`, each
(num_experts, out, in) with `.weight` (and `.scales`, `.biases` when quantized) and `.bias`;
their gate and up rows are interleaved back into `gate_up_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from baselm.metal import AttentionMetadata
from baselm.models import llama
from baselm.models.base import ModelConfigError
from baselm.models.moe import SwitchLinear

# HF's rope when a gpt-oss config gives none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama's config plus the experts, their SwiGLU clamp, and gpt-oss's defaults."""

    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    sliding_window: int | None = 128
    rms_norm_eps: float = 1e-5

    default_rope_theta: ClassVar[float] = 150_000.0

    def __post_init__(self) -> None:
        if self.rope_scaling is None and self.rope_parameters is None:
            self.rope_parameters = dict(DEFAULT_ROPE)
        super().__post_init__()

    def resolve_layer_types(self) -> list[str]:
        """The config's `layer_types`, else even layers slide and odd ones attend globally."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ModelConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_local_experts ({self.num_local_experts})"
            )
        super().validate()


class ClampedSwiGLUExperts(nn.Module):
    """The experts: down(clamped SwiGLU(gate_up(x))), with a bias on each projection.

    gate and up come interleaved out of one projection (even and odd features). The gate is
    clamped above at `limit`, up to [-limit, limit]; then (up + 1) * gate * sigmoid(alpha * gate).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = SwitchLinear(hidden_size, 2 * intermediate_size, num_experts, bias=True)
        self.down_proj = SwitchLinear(intermediate_size, hidden_size, num_experts, bias=True)
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, hidden); expert_ids: (num_tokens, k); returns (num_tokens, k, hidden)."""
        gate_up = self.gate_up_proj(x[:, None, None, :], expert_ids)  # (num_tokens, k, 1, 2 * inter)
        gate = mx.minimum(gate_up[..., ::2], self.limit)
        up = mx.clip(gate_up[..., 1::2], -self.limit, self.limit)
        h = (up + 1) * (gate * mx.sigmoid(gate * self.alpha))  # (num_tokens, k, 1, inter)
        return self.down_proj(h, expert_ids)[:, :, 0, :]


class TopKSoftmaxMoE(nn.Module):
    """Routing: the k largest router logits (with the router's bias) pick the experts, and a softmax
    over those k logits alone weights their outputs."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts_per_tok = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = ClampedSwiGLUExperts(
            args.hidden_size, args.intermediate_size, args.num_local_experts, args.swiglu_alpha, args.swiglu_limit
        )

    def __call__(self, x: mx.array, meta: AttentionMetadata | None = None) -> mx.array:
        """x: (num_tokens, hidden) -> (num_tokens, hidden). `meta` is not read: experts take no adapters."""
        expert_ids, weights = self.route(x)
        out = self.experts(x, expert_ids)  # (num_tokens, k, hidden)
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: (num_tokens, hidden) -> the picked experts, (num_tokens, k) unordered, and their weights (float32)."""
        k = self.num_experts_per_tok
        logits = self.router(x)  # (num_tokens, num_experts)
        expert_ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # (num_tokens, k), unordered
        top = mx.take_along_axis(logits, expert_ids, axis=-1).astype(mx.float32)  # (num_tokens, k)
        return expert_ids, mx.softmax(top, axis=-1, precise=True)


class Model(llama.Model):
    """Llama's decoder with sinks in every attention and the routed experts in every layer."""

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        return {**super().attention_options(args, layer_idx), "sinks": True}

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return TopKSoftmaxMoE(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            for proj in ("gate_up_proj", "down_proj"):
                _rename_experts(weights, f"layers.{i}.mlp.experts.{proj}")
            _fuse_split_experts(weights, f"layers.{i}.mlp.experts")
        return weights


def _rename_experts(weights: dict[str, mx.array], name: str) -> None:
    """HF's stacked expert tensors of projection `name` under SwitchLinear's names, in place."""
    if name in weights:  # float: (num_experts, in, out) -> (num_experts, out, in)
        weights[name + ".weight"] = weights.pop(name).swapaxes(-1, -2)
    if name + "_bias" in weights:
        weights[name + ".bias"] = weights.pop(name + "_bias")
    if name + "_blocks" in weights:
        blocks = weights.pop(name + "_blocks")  # (num_experts, out, in / 32, 16) uint8
        if blocks.dtype != mx.uint8 or blocks.shape[-1] != 16 or name + "_scales" not in weights:
            raise ModelConfigError(
                f"{name}_blocks is not an MXFP4 tensor: expected uint8 (..., 16) blocks with {name}_scales beside"
            )
        codes = blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)  # (num_experts, out, in / 8)
        weights[name + ".weight"] = codes
        weights[name + ".scales"] = weights.pop(name + "_scales")  # (num_experts, out, in / 32)


def _fuse_split_experts(weights: dict[str, mx.array], prefix: str) -> None:
    """mlx-lm's split `gate_proj`/`up_proj` experts as one `gate_up_proj`, gate and up rows interleaved, in place.

    Rows move whole, so quantized codes, scales and biases interleave the same way as float weights.
    """
    for suffix in ("weight", "scales", "biases", "bias"):
        gate = weights.pop(f"{prefix}.gate_proj.{suffix}", None)
        up = weights.pop(f"{prefix}.up_proj.{suffix}", None)
        if gate is None and up is None:
            continue
        if gate is None or up is None or gate.shape != up.shape:
            raise ModelConfigError(f"checkpoint has {prefix} gate and up experts that do not pair up ({suffix})")
        fused = mx.stack([gate, up], axis=2)  # (num_experts, inter, 2[, X])
        weights[f"{prefix}.gate_up_proj.{suffix}"] = fused.reshape(gate.shape[0], -1, *gate.shape[2:])
