"""Gemma 2: Llama-like with sandwich norms, (1 + w) RMSNorm, a scaled embedding, soft-capped
attention scores and logits, and sliding-window layers alternating with global ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.cpu import fused
from baselm.kv.cache import LayerKV
from baselm.metal import AttentionMetadata
from baselm.models import llama
from baselm.models.attention import Attention
from baselm.models.mlp import MLP


@dataclass
class ModelArgs(llama.ModelArgs):
    """Llama's config plus Gemma 2's soft-caps, attention scale and alternating layer types."""

    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = True

    def resolve_layer_types(self) -> list[str]:
        """The config's `layer_types`, else even layers slide and odd ones attend globally."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)]


class GemmaRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight): Gemma checkpoints store the offset from one."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        out = fused.rms_norm(x, self.weight, self.eps, weight_offset=1.0)
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps) if out is None else out


class SandwichDecoderLayer(llama.DecoderLayer):
    """Norms on both sides of each sublayer: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__(self_attn, mlp, make_norm)
        self.pre_feedforward_layernorm = make_norm()
        self.post_feedforward_layernorm = make_norm()

    def __call__(self, x: mx.array, positions: mx.array, meta: AttentionMetadata, layer_kv: LayerKV) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, meta, layer_kv))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), meta))


class Model(llama.Model):
    """Llama's decoder with sandwich norms, (1 + w) RMSNorm, a scaled embedding and soft-capped logits."""

    def make_norm(self, dims: int | None = None) -> nn.Module:
        return GemmaRMSNorm(dims or self.args.hidden_size, eps=self.args.rms_norm_eps)

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        return {
            **super().attention_options(args, layer_idx),
            "scale": args.query_pre_attn_scalar**-0.5,
            "softcap": args.attn_logit_softcapping,
        }

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return MLP(args.hidden_size, args.intermediate_size, args.hidden_activation)

    def make_layer(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        attention, mlp = self.make_attention(args, layer_idx), self.make_mlp(args, layer_idx)
        return SandwichDecoderLayer(attention, mlp, self.make_norm)

    def embed(self, input_ids: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        # The scale is rounded to the activation dtype first, as the checkpoints were trained.
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)

    def lm_logits(self, h: mx.array) -> mx.array:
        logits = super().lm_logits(h)  # (num_logits, vocab_size)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap
