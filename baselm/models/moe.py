"""Sparse mixture of experts (Mixtral, Qwen3-MoE): stacked expert weights, top-k routing, and
the weight maps that stack a checkpoint's per-expert tensors."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.metal import AttentionMetadata
from baselm.models.base import ModelConfigError
from baselm.models.mlp import activation


class SwitchLinear(nn.Module):
    """One linear layer per expert, weights stacked: (num_experts, out, in), biases (num_experts, out)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, k or 1, 1, in); expert_ids: (num_tokens, k); returns (num_tokens, k, 1, out)."""
        return _add_bias(self, mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=expert_ids), expert_ids)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any) -> nn.Module:
        """The quantized twin, so `nn.quantize` (and quantized checkpoints) cover the experts too."""
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode, self.get("bias"))


def _add_bias(layer: nn.Module, out: mx.array, expert_ids: mx.array) -> mx.array:
    """`out` (num_tokens, k, 1, out) plus each picked expert's bias, when the layer has biases."""
    if "bias" not in layer:
        return out
    return out + layer.bias[expert_ids][:, :, None, :]


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear over quantized stacked weights: codes (num_experts, out, in * bits / 32).

    `mode` is MLX's: "affine" (float scales and biases per group) or "mxfp4" (FP4 E2M1 codes with
    one power-of-two E8M0 scale per 32 inputs, stored as uint8, and no quantization biases).
    """

    def __init__(
        self, weight: mx.array, group_size: int, bits: int, mode: str = "affine", bias: mx.array | None = None
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, k or 1, 1, in); expert_ids: (num_tokens, k); returns (num_tokens, k, 1, out)."""
        out = mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=expert_ids,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return _add_bias(self, out, expert_ids)


class SwitchGLU(nn.Module):
    """The experts of a sparse MoE: a gated MLP per expert, run only for the experts each token picked."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden_size, intermediate_size, num_experts)
        self.up_proj = SwitchLinear(hidden_size, intermediate_size, num_experts)
        self.down_proj = SwitchLinear(intermediate_size, hidden_size, num_experts)
        self.act = activation(act)

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, hidden); expert_ids: (num_tokens, k); returns (num_tokens, k, hidden)."""
        x = x[:, None, None, :]  # (num_tokens, 1, 1, hidden)
        h = self.act(self.gate_proj(x, expert_ids)) * self.up_proj(x, expert_ids)  # (num_tokens, k, 1, inter)
        return self.down_proj(h, expert_ids)[:, :, 0, :]


class SparseMoE(nn.Module):
    """Top-k routed mixture of gated-MLP experts (Mixtral, Qwen3-MoE).

    The router's softmax runs over all experts in float32; the k largest probabilities weight
    their experts' outputs, renormalized to sum to one when `norm_topk_prob`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
        act: str = "silu",
    ):
        super().__init__()
        if not 0 < num_experts_per_tok <= num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok ({num_experts_per_tok}) must be between 1 and "
                f"the number of experts ({num_experts})"
            )
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = SwitchGLU(hidden_size, intermediate_size, num_experts, act)

    def __call__(self, x: mx.array, meta: AttentionMetadata | None = None) -> mx.array:
        """x: (num_tokens, hidden) -> (num_tokens, hidden). `meta` is not read: experts take no adapters."""
        expert_ids, weights = self.route(x)
        out = self.experts(x, expert_ids)  # (num_tokens, k, hidden)
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: (num_tokens, hidden) -> the experts each token picked, (num_tokens, k) unordered, and
        their weights, (num_tokens, k) float32."""
        k = self.num_experts_per_tok
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)  # (num_tokens, num_experts)
        expert_ids = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # (num_tokens, k), unordered
        weights = mx.take_along_axis(probs, expert_ids, axis=-1)  # (num_tokens, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return expert_ids, weights


def stack_experts(
    weights: dict[str, mx.array], prefix: str, num_experts: int, names: dict[str, str]
) -> dict[str, mx.array]:
    """Stacks per-expert tensors `{prefix}.experts.{e}.{src}.*` into `{prefix}.experts.{dst}.*`, in place.

    `names` maps each checkpoint projection name to the SwitchGLU one (e.g. "w1" -> "gate_proj").
    The suffix (weight, or a quantized triplet's scales/biases) is kept. An MLX folder's experts,
    stacked already under mlx-lm's `{prefix}.switch_mlp.{dst}.*`, are only renamed.
    """
    for key in [k for k in weights if k.startswith(f"{prefix}.switch_mlp.")]:
        weights[key.replace(".switch_mlp.", ".experts.", 1)] = weights.pop(key)
    for src, dst in names.items():
        for suffix in ("weight", "scales", "biases"):
            keys = [f"{prefix}.experts.{e}.{src}.{suffix}" for e in range(num_experts)]
            present = [k for k in keys if k in weights]
            if not present:
                continue
            if len(present) < num_experts:
                missing = next(k for k in keys if k not in weights)
                raise ModelConfigError(f"checkpoint lacks expert tensor {missing}")
            weights[f"{prefix}.experts.{dst}.{suffix}"] = mx.stack([weights.pop(k) for k in keys])
    return weights


def split_fused_experts(weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """Splits a stacked `{prefix}.experts.gate_up_proj` (num_experts, 2 * inter, hidden) in place.

    Some checkpoints store the experts fused this way, with `down_proj` stacked but suffix-less.
    """
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        gate, up = mx.split(fused, 2, axis=1)
        weights[f"{prefix}.experts.gate_proj.weight"] = gate
        weights[f"{prefix}.experts.up_proj.weight"] = up
    down = weights.pop(f"{prefix}.experts.down_proj", None)
    if down is not None:
        weights[f"{prefix}.experts.down_proj.weight"] = down
    return weights
