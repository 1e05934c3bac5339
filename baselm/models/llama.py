"""Llama (and the many checkpoints shaped like it): pre-norm decoder, GQA, SwiGLU, RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.models.base import BaseModelArgs, DecoderModel, ModelConfigError
from baselm.models.layers import MLP, Attention, RoPE, select_logits


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs, self_attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, positions: mx.array, meta, layer_kv) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), positions, meta, layer_kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(DecoderModel):
    """Llama-family decoder; other files reuse it with their own attention or MLP options."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.make_layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_attention(self, args: ModelArgs, layer_idx: int) -> Attention:
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        return Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            window=args.sliding_window,
        )

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return MLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=args.mlp_bias)

    def make_layer(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return DecoderLayer(args, self.make_attention(args, layer_idx), self.make_mlp(args, layer_idx))

    def __call__(self, input_ids: mx.array, positions: mx.array, meta, cache) -> mx.array:
        h = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, meta, cache[i])
        h = self.norm(select_logits(h, meta))
        return self.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
