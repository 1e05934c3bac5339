"""What every model file shares: config parsing and the model interface the engine sees."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.kv.cache import PagedKVCache
from baselm.metal import AttentionMetadata


class ModelConfigError(ValueError):
    """A model's config is missing something or holds a value we cannot run."""


def classifier_labels(config: Mapping[str, Any]) -> list[str] | None:
    """The labels of the classification head an HF config describes, in the order of the head's rows,
    or None for a model without one.

    A `*ForSequenceClassification` checkpoint (transformers' `GenericForSequenceClassification`) is the
    decoder with a `score` linear layer (num_labels, hidden), no bias, in place of the LM head, read at
    the last token that is not padding. As transformers: the labels are `id2label`'s, else `num_labels`
    of them named LABEL_i, else two (a config saved with the default two labels names none).
    """
    architectures = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return None
    id2label = config.get("id2label") or {}
    if id2label:
        by_index = {int(i): str(label) for i, label in id2label.items()}
        if sorted(by_index) != list(range(len(by_index))):
            raise ModelConfigError(f"config.json's id2label numbers its labels {sorted(by_index)}, not 0 to n-1")
        return [by_index[i] for i in range(len(by_index))]
    num_labels = config.get("num_labels", 2)
    if not isinstance(num_labels, int) or num_labels < 1:
        raise ModelConfigError(f"config.json's num_labels is {num_labels!r}, not a positive count")
    return [f"LABEL_{i}" for i in range(num_labels)]


@dataclasses.dataclass
class BaseModelArgs:
    """Base of each architecture's `ModelArgs`: built from an HF config dict, unknown keys dropped."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> BaseModelArgs:
        params = inspect.signature(cls).parameters
        missing = [name for name, p in params.items() if p.default is inspect.Parameter.empty and name not in config]
        if missing:
            raise ModelConfigError(f"config.json lacks {', '.join(missing)} needed by {cls.__module__}")
        args = cls(**{k: v for k, v in config.items() if k in params})
        args.validate()
        return args

    def validate(self) -> None:
        """Raises ModelConfigError for values the model cannot run with."""


@dataclasses.dataclass(slots=True)
class ImageEmbeddings:
    """A step's image rows: flattened tokens whose embeddings come from a vision tower, not the vocabulary."""

    rows: mx.array  # (num_image_rows,) int32 rows of the step's flattened tokens
    embeddings: mx.array  # (num_image_rows, hidden)

    def merge(self, h: mx.array) -> mx.array:
        """`h` (num_tokens, hidden), the token embeddings, with the image rows put in."""
        h[self.rows] = self.embeddings.astype(h.dtype)
        return h


class DecoderModel(nn.Module):
    """Interface of every model: flattened tokens of several sequences in, logits out.

    Subclasses set `self.args`, `self.layers`, and implement `__call__` and `sanitize`.
    """

    args: Any
    # Rows of the positions the model takes: 1, or 3 for M-RoPE (a temporal, height and width
    # position per token; `rope_positions` gives a prompt's).
    position_rows: int = 1

    def __call__(
        self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata, cache: PagedKVCache
    ) -> mx.array:
        """input_ids, positions: (num_tokens,) (positions (3, num_tokens) where `position_rows` is 3);
        returns logits (num_logits, vocab_size), or a classifier's (num_logits, num_labels).

        Layer `i` writes and reads the pools of `cache[i]`, a LayerKV. Logits are computed only
        at `meta.logits_indices` (all tokens when None).
        """
        raise NotImplementedError

    def hidden_states(
        self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata, cache: PagedKVCache
    ) -> mx.array:
        """The final normed hidden state of every token, (num_tokens, hidden): what embeddings pool."""
        raise ModelConfigError(f"{type(self).__module__} does not expose its hidden states")

    @property
    def is_classifier(self) -> bool:
        """Whether the logits are a classification head's, (num_logits, num_labels), rather than the vocabulary's."""
        return False

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Maps checkpoint tensors to this module's parameter names (drops unused ones)."""
        return weights

    def embed_image(self, pixels: mx.array, extra: dict[str, Any]) -> mx.array:
        """A vision-language model's embeddings of one preprocessed image: (num_image_tokens, hidden),
        one row per placeholder token, in prompt order. Text-only models have none."""
        raise ModelConfigError(f"{type(self).__module__} reads text only; it has no vision tower")

    def rope_positions(self, num_prompt_tokens: int, images: Any) -> tuple[Any, int]:
        """An M-RoPE model's (3, num_prompt_tokens) int32 positions of a prompt with `images` (its
        PromptImages) and the delta of the tokens after it (position = index + delta); other models'
        positions are the token indices and they have none."""
        raise ModelConfigError(f"{type(self).__module__} places tokens at their indices; it has no M-RoPE positions")

    def divide_rope_frequencies(self, factors: mx.array) -> None:
        """Divides each RoPE frequency by its factor, (rotary_dims // 2,): llama 3 scaling as llama.cpp's
        converter stores it, beside the weights rather than in the config. Only Llama-like models take it."""
        raise ModelConfigError(f"{type(self).__module__} takes no per-frequency RoPE factors")

    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache this model needs."""
        a = self.args
        return a.num_hidden_layers, a.num_key_value_heads, a.head_dim

    @property
    def dtype(self) -> mx.Dtype:
        return self.embed_dtype()

    def embed_dtype(self) -> mx.Dtype:
        """The activations' dtype: the first float parameter's, quantization scales aside (they
        may be stored narrower than the compute dtype)."""
        for name, value in nn.utils.tree_flatten(self.parameters()):
            if mx.issubdtype(value.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
                return value.dtype
        return mx.float32


def select_logits(hidden: mx.array, meta: AttentionMetadata) -> mx.array:
    """Rows of `hidden` (num_tokens, hidden) whose logits are wanted: (num_logits, hidden)."""
    return hidden if meta.logits_indices is None else hidden[meta.logits_indices]
