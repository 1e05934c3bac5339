"""Pieces shared by the model files: RoPE, the attention call, gated MLPs, Gemma's RMSNorm, sparse MoE."""

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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    inv_freq: np.ndarray, dims: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between; and the cos/sin scale."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

    def dim_for(rotations: float) -> float:
        return dims * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low if high != low else 1e-3), 0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    mscale = scaling.get("attention_factor")
    if mscale is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return inv, mscale


def _longrope_freqs(
    dims: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Short and long per-dimension periods and the cos/sin scale of LongRoPE (Phi-3)."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    freqs = []
    for key in ("short_factor", "long_factor"):
        ext = np.asarray(scaling[key], dtype=np.float64)
        if ext.shape != periods.shape:
            raise ModelConfigError(f"longrope {key} has {ext.size} values, but {dims} rotary dims need {periods.size}")
        freqs.append(ext * periods)
    return freqs[0], freqs[1], old_len, mscale


class RoPE(nn.Module):
    """Rotary embedding at arbitrary per-token positions (HF "rotate half" layout by default).

    Supports rope types default, linear, dynamic (as default within the trained length),
    llama3, yarn and longrope. Positions come per token, so sequences of a batch need not align.
    `dims` below the head size rotates only the first `dims` features (partial rotary).
    """

    def __init__(
        self,
        dims: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        traditional: bool = False,
        max_position_embeddings: int = 4096,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = 1.0
        self._long_freqs = None
        inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
        kind = rope_type(scaling)
        try:
            inv_freq = self._scaled(kind, inv_freq, dims, base, scaling, max_position_embeddings)
        except KeyError as exc:
            raise ModelConfigError(f"rope type {kind!r} needs {exc.args[0]!r} in the config's rope scaling") from None
        self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))  # (dims // 2,) periods / 2pi

    def _scaled(
        self, kind: str, inv_freq: np.ndarray, dims: int, base: float, scaling: Any, max_position_embeddings: int
    ) -> np.ndarray:
        """inv_freq after the scaling of rope type `kind`; sets the cos/sin scale and long factors it implies."""
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.mscale = _yarn_inv_freq(inv_freq, dims, base, scaling, max_position_embeddings)
        elif kind == "longrope":
            short, long, self._long_from, self.mscale = _longrope_freqs(dims, base, scaling, max_position_embeddings)
            inv_freq = 1.0 / short
            self._long_freqs = mx.array(long.astype(np.float32))  # (dims // 2,)
        elif kind not in ("default", "dynamic"):
            raise ModelConfigError(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        return inv_freq

    def divide_frequencies(self, factors: mx.array) -> None:
        """Divides each rotary frequency by its factor, (dims // 2,): llama 3 scaling as GGUF stores it."""
        if factors.shape != self._freqs.shape:
            raise ModelConfigError(
                f"rope_freqs has {factors.size} factors, but {self.dims} rotary dims need {self._freqs.size}"
            )
        self._freqs = self._freqs * factors.astype(mx.float32)

    def _rotate(self, x: mx.array, positions: mx.array, freqs: mx.array) -> mx.array:
        # Each token is its own batch entry with a length-1 sequence at offset = its position.
        return mx.fast.rope(
            x[:, :, None, :],
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=positions,
            freqs=freqs,
        )[:, :, 0, :]

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x: (num_tokens, heads, head_dim); positions: (num_tokens,)."""
        out = self._rotate(x, positions, self._freqs)
        if self._long_freqs is not None:
            # NOTE: LongRoPE switches to its long factors past the trained length. HF decides per
            # forward call (by the largest position); here each token decides by its own position,
            # which agrees with HF whenever a call's positions all lie on one side of that length.
            is_long = (positions >= self._long_from)[:, None, None]
            out = mx.where(is_long, self._rotate(x, positions, self._long_freqs), out)
        if self.mscale != 1.0:
            rotated = out[..., : self.dims] * self.mscale
            out = rotated if self.dims == out.shape[-1] else mx.concatenate([rotated, out[..., self.dims :]], -1)
        return out


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(params: dict[str, Any] | None) -> str:
    """The rope type of an HF rope dict (`rope_type`, or the older `type`; "su" is longrope's old name)."""
    kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind


def make_rope(head_dim: int, params: dict[str, Any], max_position_embeddings: int) -> RoPE:
    """RoPE from a resolved HF rope dict: `rope_theta`, optional `partial_rotary_factor` and scaling keys."""
    dims = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dims % 2 or not 0 < dims <= head_dim:
        raise ModelConfigError(
            f"partial_rotary_factor gives {dims} rotary dims for head_dim {head_dim}; need an even count"
        )
    return RoPE(dims, params["rope_theta"], params, max_position_embeddings=max_position_embeddings)


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

    def fuse(self) -> None:
        """Computes q, k and v with one matmul (one dispatch instead of three; CPU decode is
        dispatch-bound). The separate weights become views of the fused one: no extra memory."""
        self._qkv = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        qkv = getattr(self, "_qkv", None)
        if qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return mx.split(_linear(x, *qkv), [q_size, q_size + kv_size], axis=-1)

    def __call__(self, x: mx.array, positions: mx.array, meta, layer_kv) -> mx.array:
        num_tokens = x.shape[0]
        q, k, v = self._project(x)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
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

    def fuse(self) -> None:
        """One matmul for gate and up (see Attention.fuse)."""
        self._gate_up = _fuse_linears([self.gate_proj, self.up_proj])

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = getattr(self, "_gate_up", None)
        if gate_up is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = mx.split(_linear(x, *gate_up), 2, axis=-1)
        return self.down_proj(self.act(gate) * up)


def _linear(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def _fuse_linears(linears: list[nn.Linear]) -> tuple[mx.array, mx.array | None]:
    """(weight, bias) of the stacked outputs; each linear's own arrays become views into them."""
    weight = mx.concatenate([lin.weight for lin in linears], axis=0)  # (sum of out, in)
    has_bias = "bias" in linears[0]
    bias = mx.concatenate([lin.bias for lin in linears]) if has_bias else None
    mx.eval([weight] if bias is None else [weight, bias])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = weight[start : start + rows]
        if has_bias:
            lin.bias = bias[start : start + rows]
        start += rows
    return weight, bias


def fuse_projections(model: nn.Module) -> None:
    """Fuses q/k/v and gate/up matmuls of every dense (not quantized) layer of `model`."""
    for _, module in model.named_modules():
        if isinstance(module, Attention) and all(
            type(getattr(module, n)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj")
        ):
            module.fuse()
        elif isinstance(module, MLP) and type(module.gate_proj) is nn.Linear and type(module.up_proj) is nn.Linear:
            module.fuse()


def select_logits(hidden: mx.array, meta) -> mx.array:
    """Rows of `hidden` (num_tokens, hidden) whose logits are wanted."""
    return hidden if meta.logits_indices is None else hidden[meta.logits_indices]


class GemmaRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight): Gemma checkpoints store the offset from one."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class SwitchLinear(nn.Module):
    """One bias-free linear layer per expert, weights stacked: (num_experts, out, in)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, k or 1, 1, in); expert_ids: (num_tokens, k); returns (num_tokens, k, 1, out)."""
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=expert_ids)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any) -> nn.Module:
        """The quantized twin, so `nn.quantize` (and quantized checkpoints) cover the experts too."""
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear over affine-quantized stacked weights: codes (num_experts, out, in * bits / 32)."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits, mode=mode)

    def __call__(self, x: mx.array, expert_ids: mx.array) -> mx.array:
        """x: (num_tokens, k or 1, 1, in); expert_ids: (num_tokens, k); returns (num_tokens, k, 1, out)."""
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=expert_ids,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


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

    def __call__(self, x: mx.array) -> mx.array:
        """x: (num_tokens, hidden) -> (num_tokens, hidden)."""
        k = self.num_experts_per_tok
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)  # (num_tokens, num_experts)
        expert_ids = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # (num_tokens, k), unordered
        weights = mx.take_along_axis(probs, expert_ids, axis=-1)  # (num_tokens, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = self.experts(x, expert_ids)  # (num_tokens, k, hidden)
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)


def stack_experts(
    weights: dict[str, mx.array], prefix: str, num_experts: int, names: dict[str, str]
) -> dict[str, mx.array]:
    """Stacks per-expert tensors `{prefix}.experts.{e}.{src}.*` into `{prefix}.experts.{dst}.*`, in place.

    `names` maps each checkpoint projection name to the SwitchGLU one (e.g. "w1" -> "gate_proj").
    The suffix (weight, or a quantized triplet's scales/biases) is kept.
    """
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
