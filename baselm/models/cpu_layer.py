"""A Llama-shaped decoder layer as one CPU kernel call (`csrc/layer.cpp`), where it applies.

MLX's CPU backend evaluates its graph one node at a time, and a decode step of a small model
is hundreds of small nodes (a norm, a matmul, a rotation, a KV write...) plus the Python that
builds them. For few-row steps the kernel runs the whole pre-norm layer, norm to residual, in
one node, calling the same loops as the per-op kernels; the per-op path stays as its oracle
and serves everything else.

It applies when the kernels module is loaded, MLX runs on the CPU, the step has at most
`LAYER_MAX_ROWS` tokens in float32 and no rows of a LoRA adapter (the per-op path adds their
deltas, baselm/models/lora.py), the pools are plain float32, and the layer is the plain
shape: RMSNorm (no weight offset), q/k/v and gate/up projections (fused, or up to 3 pieces
each) on float32, affine or GGUF block weights, RoPE (any kind but LongRoPE) or none, no q/k
norms or attention sinks, a gated activation the kernel knows. `BASE_CPU_LAYER=0`
(`baselm.cpu.fused.layer_enabled`) keeps the per-op path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm import cpu, gguf_blocks
from baselm.cpu import fused
from baselm.cpu.fused import GATED_ACTIVATIONS
from baselm.kv.cache import LayerKV
from baselm.metal import AttentionMetadata
from baselm.models.attention import Attention
from baselm.models.linear import DENSE_KERNEL_MAX_ROWS, BlockLinear, KernelLinear, KernelQuantizedLinear
from baselm.models.mlp import MLP
from baselm.models.norm import RMSNorm
from baselm.paged_attention import query_starts

# Steps up to this many tokens run as one node per layer (the float32 kernel's own row limit:
# beyond it prefill's matmuls go to BLAS GEMM, and a node per op costs little beside them).
LAYER_MAX_ROWS = DENSE_KERNEL_MAX_ROWS

_NOT_FUSABLE = "not fusable"


def _linear_parts(layer: nn.Module) -> tuple[list[mx.array], int, int] | None:
    """(arrays, bits, group_size) of a kernel-backed linear layer; bits 0 for float32 weights."""
    bias = [layer["bias"]] if "bias" in layer else []
    if type(layer) is KernelLinear:
        return [layer.weight, *bias], 0, 0
    if type(layer) is KernelQuantizedLinear:
        return [layer.weight, layer.scales, layer.biases, *bias], layer.bits, layer.group_size
    if type(layer) is BlockLinear:  # the kernels take the block type where they take bits
        return [layer.weight, *bias], gguf_blocks.BY_SUFFIX[layer.kind].kernel_enum(layer.runs), 32
    return None


QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def _fused(module: nn.Module, fused: str, names: tuple[str, ...]) -> list[nn.Module]:
    """[the fused projection], or its parts where they could not be fused (GGUF files mix formats)."""
    layer = getattr(module, fused, None)
    return [layer[0]] if layer is not None else [getattr(module, name) for name in names]


def _projection(linears: list[nn.Module]) -> tuple[Any, Any, Any] | None:
    """The kernel's (arrays, bits, group size) of one layer, or lists of them for several stacked."""
    parts = [_linear_parts(lin) for lin in linears]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else tuple(list(column) for column in zip(*parts, strict=True))


def _plan(layer: nn.Module) -> dict[str, Any] | None:
    """The kernel's fixed arguments for `layer`, or None when its shape is not the kernel's."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, Attention):  # a tensor-parallel slice: its partial sums meet between the two halves
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != mx.float32 for n in norms):
        return None
    if attn.has_qk_norm or attn.has_sinks or attn.head_dim % 16:
        return None
    if type(mlp) is not MLP or mlp.act_name not in GATED_ACTIVATIONS:
        return None
    rope = attn.rope
    if rope is not None and (rope._long_freqs is not None or rope._freqs.dtype != mx.float32):
        return None
    parts = [
        _projection(lin)
        for lin in (_fused(attn, "_qkv", QKV), [attn.o_proj], _fused(mlp, "_gate_up", GATE_UP), [mlp.down_proj])
    ]
    if any(p is None for p in parts):
        return None
    return {
        "norms": [n.weight for n in norms],
        "linears": [p[0] for p in parts],
        "bits": [p[1] for p in parts],
        "group_sizes": [p[2] for p in parts],
        "freqs": None if rope is None else rope._freqs,
        "rope_dims": 0 if rope is None else rope.dims,
        "traditional": False if rope is None else rope.traditional,
        "mscale": 1.0 if rope is None else float(rope.mscale),
        "num_heads": attn.num_heads,
        "scale": float(attn.scale),
        "softcap": None if attn.softcap is None else float(attn.softcap),
        "window": attn.window,
        "eps": float(norms[0].eps),
        "act": GATED_ACTIVATIONS[mlp.act_name],
    }


def plan_for(layer: nn.Module) -> dict[str, Any] | None:
    """The layer's kernel arguments, worked out once (the weights of a loaded model are fixed)."""
    plan = layer.__dict__.get("_cpu_plan")
    if plan is None:
        plan = _plan(layer) or _NOT_FUSABLE
        layer.__dict__["_cpu_plan"] = plan
    return None if plan is _NOT_FUSABLE else plan


def applies(x: mx.array, meta: AttentionMetadata, layer_kv: LayerKV) -> bool:
    """Whether this step's inputs suit the kernel (the layer's own shape is `plan_for`'s)."""
    if not fused.layer_enabled or cpu.kernels is None or mx.default_device() != mx.cpu or meta.adapter_rows:
        return False
    keys = layer_kv.keys
    return (
        x.dtype == mx.float32
        and x.ndim == 2
        and x.shape[0] <= LAYER_MAX_ROWS
        and isinstance(keys, mx.array)
        and keys.dtype == mx.float32
        and layer_kv.values.dtype == mx.float32
    )


def decoder_layer(
    layer: nn.Module, x: mx.array, positions: mx.array, meta: AttentionMetadata, layer_kv: LayerKV
) -> mx.array | None:
    """x + attn(norm(x)), then + mlp(norm(.)), as one kernel call writing this step's K/V into
    `layer_kv` (rebound to the pools the call returns); None when the kernel does not apply (also
    when some queries see past their own position: its attention is causal only, or positions have
    M-RoPE's three rows)."""
    if meta.attend_until is not None or positions.ndim != 1 or not applies(x, meta, layer_kv):
        return None
    plan = plan_for(layer)
    if plan is None:
        return None
    out, layer_kv.keys, layer_kv.values = cpu.kernels.decoder_layer(
        x,
        positions,
        meta.slot_mapping,
        meta.block_tables,
        meta.context_lens,
        query_starts(meta),
        layer_kv.keys,
        layer_kv.values,
        **plan,
    )
    return out  # (num_tokens, hidden)
