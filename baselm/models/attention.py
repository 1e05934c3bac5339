"""The one attention layer of the model files: project, RoPE, write K/V to the cache, paged attention."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from baselm.kv.cache import LayerKV
from baselm.metal import AttentionCall, AttentionMetadata
from baselm.models.base import ModelConfigError
from baselm.models.linear import fuse_linears, fused_linear
from baselm.models.lora import add_lora
from baselm.models.norm import RMSNorm
from baselm.models.rope import RoPE
from baselm.paged_attention import paged_attention


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA over the paged KV pools.

    Options cover the architectures here: projection biases (qwen2), q/k RMS norms (qwen3,
    gemma3), score soft-capping and a sliding window (gemma2/3), no position rotation in some
    layers (`rope=None`, smollm3), and a learned sink logit per head (`sinks`, gpt-oss). The
    projections take LoRA adapters chosen per request (`lora_projections`, baselm/models/lora.py).
    """

    lora_projections = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RoPE | None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        norm_cls: type[nn.Module] = RMSNorm,
        sinks: bool = False,
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
        if sinks:
            self.sinks = mx.zeros((num_heads,))
        self.has_sinks = sinks

    def fuse(self) -> None:
        """Computes q, k and v with one matmul (one dispatch instead of three; CPU decode is
        dispatch-bound). The separate weights become views of the fused one: no extra memory."""
        self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def _project(self, x: mx.array, meta: AttentionMetadata) -> list[mx.array]:
        qkv = getattr(self, "_qkv", None)
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if qkv is None:
            outs = [linear(x) for linear in linears]
        else:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            outs = mx.split(fused_linear(x, *qkv), [q_size, q_size + kv_size], axis=-1)
        return [add_lora(linear, x, out, meta) for linear, out in zip(linears, outs)]

    def __call__(self, x: mx.array, positions: mx.array, meta: AttentionMetadata, layer_kv: LayerKV) -> mx.array:
        """x: (num_tokens, hidden); positions: (num_tokens,); returns (num_tokens, hidden).

        Writes this step's keys and values into `layer_kv` at `meta.slot_mapping`, then attends over
        the pools: each token sees its sequence's cached keys up to its own position.
        """
        num_tokens = x.shape[0]
        q, k, v = self._project(x, meta)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (num_tokens, heads, head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (num_tokens, kv_heads, head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (num_tokens, kv_heads, head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        layer_kv.write(k, v, meta)
        sinks = self.sinks if self.has_sinks else None
        call = AttentionCall(q, layer_kv.keys, layer_kv.values, meta, self.scale, self.softcap, self.window, sinks)
        out = paged_attention(call)  # (num_tokens, heads, head_dim)
        out = out.reshape(num_tokens, -1)  # (num_tokens, heads * head_dim)
        return add_lora(self.o_proj, out, self.o_proj(out), meta)
