"""The gated MLP of the dense model files, and the activations their configs name."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from baselm.cpu import fused
from baselm.metal import AttentionMetadata
from baselm.models.base import ModelConfigError
from baselm.models.linear import fuse_linears, fused_linear
from baselm.models.lora import add_lora

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
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu. Its projections take
    LoRA adapters chosen per request (`lora_projections`, baselm/models/lora.py)."""

    lora_projections = ("gate_proj", "up_proj", "down_proj")

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

    def __call__(self, x: mx.array, meta: AttentionMetadata | None = None) -> mx.array:
        """x (num_tokens, hidden) -> (num_tokens, hidden); `meta` names the step's adapter rows."""
        gate_up = getattr(self, "_gate_up", None)
        if gate_up is None:
            gate, up = (add_lora(p, x, p(x), meta) for p in (self.gate_proj, self.up_proj))
            hidden = self.act(gate) * up
        else:
            hidden = self._fused_hidden(x, gate_up[0], meta)
        return add_lora(self.down_proj, hidden, self.down_proj(hidden), meta)

    def _fused_hidden(self, x: mx.array, gate_up: nn.Module, meta: AttentionMetadata | None) -> mx.array:
        fused_out = fused_linear(x, gate_up)  # (..., 2 * intermediate): [gate | up]
        if meta is not None and meta.adapter_rows:  # each half takes its own delta before the activation
            halves = zip((self.gate_proj, self.up_proj), mx.split(fused_out, 2, axis=-1))
            fused_out = mx.concatenate([add_lora(p, x, half, meta) for p, half in halves], axis=-1)
        hidden = fused.gated_activation(fused_out, self.act_name)
        if hidden is None:
            gate, up = mx.split(fused_out, 2, axis=-1)
            hidden = self.act(gate) * up
        return hidden
