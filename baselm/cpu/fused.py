"""RMSNorm, RoPE and the MLP's gated activation as one CPU kernel call each, where they apply; and
LayerNorm and a plain activation, for the vision towers.

On the CPU MLX runs `mx.fast.rms_norm` and `mx.fast.rope` as several graph nodes each (its
fused versions exist only on GPUs), and a gated activation as four (split, sigmoid, two
multiplies); at ~5 us per node that is a large part of a decode step. In a vision tower the same
ops run over thousands of patches: MLX's tanh-approximated GELU over a (4096, 4304) activation
takes about a second on the CPU, the kernel a few tens of milliseconds. The compiled module
(csrc/fused*.cpp) does each in one node. A kernel applies when MLX runs on the CPU, the
module is loaded and the input is float32; otherwise these functions return None and the
caller runs its MLX ops.
"""

from __future__ import annotations

import os

import mlx.core as mx

from baselm import cpu

# The MLP activations (mlp.ACTIVATIONS names) the activation kernels compute, by kernel name.
GATED_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


# Whether a Llama-shaped decoder layer runs as one kernel call (baselm/models/cpu_layer.py) where
# it applies; BASE_CPU_LAYER=0 keeps the per-op kernels (for comparing the two).
layer_enabled = os.environ.get("BASE_CPU_LAYER", "1") != "0"


def kernel_applies(x: mx.array) -> bool:
    """Whether the fused CPU kernels serve an op on `x`."""
    return cpu.kernels is not None and x.dtype == mx.float32 and mx.default_device() == mx.cpu


def rms_norm(x: mx.array, weight: mx.array, eps: float, weight_offset: float = 0.0) -> mx.array | None:
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset) over the last axis, or None (not applicable)."""
    if not kernel_applies(x) or weight.dtype != mx.float32:
        return None
    return cpu.kernels.rms_norm(x, weight, eps, weight_offset)


def rope(
    x: mx.array, positions: mx.array, freqs: mx.array, dims: int, traditional: bool, mscale: float
) -> mx.array | None:
    """x (num_tokens, heads, head_dim) rotated at `positions` by the periods `freqs` (dims // 2,), the
    rotated part scaled by `mscale`, or None (not applicable)."""
    if not kernel_applies(x) or positions.dtype != mx.int32:
        return None
    return cpu.kernels.rope(x, positions, freqs, dims, traditional, mscale)


def gated_activation(gate_up: mx.array, act: str) -> mx.array | None:
    """act(gate) * up for gate_up = [gate | up] (..., 2 * N), or None (not applicable)."""
    if act not in GATED_ACTIVATIONS or not kernel_applies(gate_up):
        return None
    return cpu.kernels.gated_activation(gate_up, GATED_ACTIVATIONS[act])


def activation(x: mx.array, act: str) -> mx.array | None:
    """act(x) elementwise, or None (not applicable)."""
    if act not in GATED_ACTIVATIONS or not kernel_applies(x):
        return None
    return cpu.kernels.activation(x, GATED_ACTIVATIONS[act])


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array | None:
    """(x - mean) * rsqrt(var + eps) * weight + bias over the last axis, or None (not applicable)."""
    if not kernel_applies(x) or any(p is not None and p.dtype != mx.float32 for p in (weight, bias)):
        return None
    if bias is not None and weight is None:
        weight = mx.ones_like(bias)
    return cpu.kernels.layer_norm(x, weight, bias, eps)


def fused_kernel_status() -> dict[str, str]:
    """For `base doctor`: the fused CPU kernels' state here."""
    if cpu.kernels is None:
        state = f"off: {cpu.status['reason']}"
    elif mx.default_device() != mx.cpu:
        state = "not used (MLX runs on a GPU)"
    else:
        state = f"used ({cpu.kernels.fused_isa()})"
    layer = state if layer_enabled or not state.startswith("used") else "off: BASE_CPU_LAYER=0"
    return {"cpu rms_norm/rope/gated activation": state, "cpu decoder layer (steps of up to 32 tokens)": layer}
