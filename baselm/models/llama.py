"""Llama (and the many checkpoints shaped like it): pre-norm decoder, GQA, SwiGLU, RoPE.

The other Llama-like files subclass `ModelArgs` and `Model` here and override a hook or two
(`resolve_layer_types`, `attention_options`, `make_mlp`, `make_layer`, `embed`, `lm_logits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from baselm.kv.cache import LayerKV, PagedKVCache
from baselm.metal import AttentionMetadata
from baselm.models import cpu_layer
from baselm.models.attention import Attention
from baselm.models.base import (
    BaseModelArgs,
    DecoderModel,
    ImageEmbeddings,
    ModelConfigError,
    classifier_labels,
    select_logits,
)
from baselm.models.mlp import MLP
from baselm.models.norm import RMSNorm
from baselm.models.rope import make_rope, rope_type

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseModelArgs):
    """The HF config keys a Llama-like decoder reads; `layer_types` is resolved per architecture."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # RoPE comes either as `rope_theta` + `rope_scaling` (older configs) or as one
    # `rope_parameters` dict (newer ones); `rope_params()` resolves both.
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # A `*ForSequenceClassification` checkpoint has a `score` head in place of the LM head.
    architectures: list[str] | None = None
    id2label: dict[str, str] | None = None
    num_labels: int | None = None

    default_rope_theta: ClassVar[float] = 10000.0

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = self.resolve_layer_types()

    def resolve_layer_types(self) -> list[str]:
        """Attention kind of each layer. Llama attends over the whole context in every layer."""
        return ["full_attention"] * self.num_hidden_layers

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelConfigError(f"layer type {unknown[0]!r} is not supported (supported: {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelConfigError("the config has sliding-attention layers but no sliding_window size")
        for layer_type in sorted(set(self.layer_types)):
            make_rope(self.head_dim, self.rope_params(layer_type), self.max_position_embeddings)
        self.score_labels()  # a malformed id2label is refused here

    def rope_params(self, layer_type: str) -> dict[str, Any]:
        """The resolved RoPE dict for layers of `layer_type`: `rope_theta` plus any scaling keys."""
        params = dict(self.rope_scaling or self.rope_parameters or {})
        params.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else self.default_rope_theta)
        return self.complete_rope_params(params)

    def complete_rope_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Adds the top-level keys HF folds into a rope dict: partial rotary, the trained length."""
        if self.partial_rotary_factor is not None:
            params.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        if rope_type(params) in ("llama3", "yarn", "longrope"):
            if self.original_max_position_embeddings is not None:  # a top-level value wins, as in HF
                params["original_max_position_embeddings"] = self.original_max_position_embeddings
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return params

    def score_labels(self) -> list[str] | None:
        """The labels of the classification head, one per row of `score`; None for a causal LM."""
        config: dict[str, Any] = {"architectures": self.architectures, "id2label": self.id2label}
        if self.num_labels is not None:
            config["num_labels"] = self.num_labels
        return classifier_labels(config)

    def layer_uses_rope(self, layer_idx: int) -> bool:
        """Whether a layer rotates its queries and keys; every Llama layer does."""
        return True

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding-window size of a layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()

    def __call__(self, x: mx.array, positions: mx.array, meta: AttentionMetadata, layer_kv: LayerKV) -> mx.array:
        if type(self) is DecoderLayer:  # the whole layer as one CPU kernel call, where it applies
            out = cpu_layer.decoder_layer(self, x, positions, meta, layer_kv)
            if out is not None:
                return out
        h = x + self.self_attn(self.input_layernorm(x), positions, meta, layer_kv)
        return h + self.mlp(self.post_attention_layernorm(h), meta)


class Model(DecoderModel):
    """Llama-family decoder; other files reuse it with their own attention or MLP options."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.make_layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = self.make_norm()
        labels = args.score_labels()
        if labels is not None:  # a classifier: its head scores the labels, not the vocabulary
            self.score = nn.Linear(args.hidden_size, len(labels), bias=False)
        elif not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_norm(self, dims: int | None = None) -> nn.Module:
        return RMSNorm(dims or self.args.hidden_size, eps=self.args.rms_norm_eps)

    def attention_options(self, args: ModelArgs, layer_idx: int) -> dict[str, Any]:
        """Keyword options of `Attention` that differ between architectures."""
        return {"qkv_bias": args.attention_bias, "o_bias": args.attention_bias}

    def make_attention(self, args: ModelArgs, layer_idx: int) -> Attention:
        rope = None
        if args.layer_uses_rope(layer_idx):
            rope = make_rope(args.head_dim, args.rope_params(args.layer_types[layer_idx]), args.max_position_embeddings)
        return Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            rope,
            window=args.layer_window(layer_idx),
            **self.attention_options(args, layer_idx),
        )

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return MLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=args.mlp_bias)

    def make_layer(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.make_attention(args, layer_idx), self.make_mlp(args, layer_idx), self.make_norm)

    def embed(self, input_ids: mx.array) -> mx.array:
        return self.embed_tokens(input_ids)  # (num_tokens, hidden)

    @property
    def is_classifier(self) -> bool:
        """Whether the model's outputs are its classification head's (one per label), not the vocabulary's."""
        return "score" in self

    def lm_logits(self, h: mx.array) -> mx.array:
        """(num_logits, hidden) normed hidden states -> (num_logits, vocab_size)."""
        return self.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)

    def last_hidden(
        self,
        input_ids: mx.array,
        positions: mx.array,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        images: ImageEmbeddings | None = None,
    ) -> mx.array:
        """The last layer's output for every token, before the final norm: (num_tokens, hidden).
        `images`: rows whose embeddings come from a vision tower instead of the vocabulary."""
        h = self.embed(input_ids)  # (num_tokens, hidden)
        if images is not None:
            h = images.merge(h)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, meta, cache[i])
        return h

    def hidden_states(
        self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata, cache: PagedKVCache
    ) -> mx.array:
        """The final normed hidden state of every token (what the LM head reads): (num_tokens, hidden)."""
        return self.norm(self.last_hidden(input_ids, positions, meta, cache))

    def __call__(
        self,
        input_ids: mx.array,
        positions: mx.array,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        images: ImageEmbeddings | None = None,
    ) -> mx.array:
        h = self.norm(select_logits(self.last_hidden(input_ids, positions, meta, cache, images), meta))
        if self.is_classifier:  # (num_logits, num_labels): the head as transformers applies it, no soft-cap
            return self.score(h)
        return self.lm_logits(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def divide_rope_frequencies(self, factors: mx.array) -> None:
        """Llama 3 scaling given as one divisor per rotary frequency, (rotary_dims // 2,), instead of in the config."""
        if rope_type(self.args.rope_params("full_attention")) != "default":
            raise ModelConfigError(
                "the checkpoint has a rope_freqs tensor and the config a rope scaling; only one may scale"
            )
        for layer in self.layers:
            if layer.self_attn.rope is not None:
                layer.self_attn.rope.divide_frequencies(factors)
