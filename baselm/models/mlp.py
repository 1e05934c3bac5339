"""The gated MLP of the dense model files, and the activations their configs name."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from baselm.cpu import fused
from baselm.models.base import ModelConfigError
from baselm.models.linear import fuse_linears, fused_linear

ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu_fast": nn.gelu_fast_approx,
}


def activation(name: str) -> Callable[[mx.array], mx.array]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelConfigError(f"activation {name!r} is not supported") from None


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def fuse(self) -> None:
        """One matmul for gate and up (see Attention.fuse)."""
        self._gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = getattr(self, "_gate_up", None)
        if gate_up is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        fused_out = fused_linear(x, *gate_up)  # (..., 2 * intermediate): [gate | up]
        hidden = fused.gated_activation(fused_out, self.act_name)
        if hidden is None:
            gate, up = mx.split(fused_out, 2, axis=-1)
            hidden = self.act(gate) * up
        return self.down_proj(hidden)
