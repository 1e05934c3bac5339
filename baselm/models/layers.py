"""Pieces shared by the model files: RoPE, the attention call, gated MLPs."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from baselm.metal import paged_attention
from baselm.models.base import ModelConfigError


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: np.ndarray, dims: int, base: float, scaling: dict[str, Any]) -> tuple[np.ndarray, float]:
    factor = scaling["factor"]
    old_len = scaling.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

    def dim_for(rotations: float) -> float:
        return dims * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / max(high - low, 1e-3), 0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, mscale


class RoPE(nn.Module):
    """Rotary embedding at arbitrary per-token positions (HF "rotate half" layout by default).

    Supports rope_scaling types default, linear, dynamic (as default within the trained
    length), llama3 and yarn. Positions come per token, so sequences of a batch need not align.
    """

    def __init__(
        self,
        dims: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        traditional: bool = False,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = 1.0
        inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.mscale = _yarn_inv_freq(inv_freq, dims, base, scaling)
        elif kind not in ("default", "dynamic"):
            raise ModelConfigError(f"rope_scaling type {kind!r} is not supported")
        self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))  # (dims // 2,) periods / 2pi

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x: (num_tokens, heads, head_dim); positions: (num_tokens,)."""
        # Each token is its own batch entry with a length-1 sequence at offset = its position.
        out = mx.fast.rope(
            x[:, :, None, :],
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=positions,
            freqs=self._freqs,
        )[:, :, 0, :]
        if self.mscale != 1.0:
            rotated = out[..., : self.dims] * self.mscale
            out = rotated if self.dims == out.shape[-1] else mx.concatenate([rotated, out[..., self.dims :]], -1)
        return out


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA over the paged KV pools.

    Options cover the architectures here: projection biases (qwen2), q/k RMS norms (qwen3,
    gemma3), score soft-capping and a sliding window (gemma2/3).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RoPE,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        norm_cls: type[nn.Module] = nn.RMSNorm,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ModelConfigError(f"{num_heads} attention heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = norm_cls(head_dim, eps=qk_norm_eps)
            self.k_norm = norm_cls(head_dim, eps=qk_norm_eps)
        self.has_qk_norm = qk_norm_eps is not None
        self.rope = rope
        self.scale = scale if scale is not None else head_dim**-0.5
        self.softcap = softcap
        self.window = window

    def __call__(self, x: mx.array, positions: mx.array, meta, layer_kv) -> mx.array:
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        layer_kv.write(k, v, meta)
        out = paged_attention(
            q, layer_kv.keys, layer_kv.values, meta, self.scale, softcap=self.softcap, window=self.window
        )  # (num_tokens, heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu_fast": nn.gelu_fast_approx,
}


def activation(name: str):
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

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def select_logits(hidden: mx.array, meta) -> mx.array:
    """Rows of `hidden` (num_tokens, hidden) whose logits are wanted."""
    return hidden if meta.logits_indices is None else hidden[meta.logits_indices]
