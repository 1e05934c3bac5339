"""RMSNorm and LayerNorm for the model files: one CPU kernel call where it applies, else MLX's `mx.fast` op."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from baselm.cpu import fused


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (weight (dims,), same parameters), through the fused CPU kernel on the CPU."""

    def __call__(self, x: mx.array) -> mx.array:
        out = fused.rms_norm(x, self.weight, self.eps)
        return super().__call__(x) if out is None else out


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (weight and bias (dims,), same parameters), through the fused CPU kernel on the CPU."""

    def __call__(self, x: mx.array) -> mx.array:
        out = fused.layer_norm(x, getattr(self, "weight", None), getattr(self, "bias", None), self.eps)
        return super().__call__(x) if out is None else out
