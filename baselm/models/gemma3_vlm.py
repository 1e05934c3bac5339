"""Gemma 3 with images (HF `gemma3`, Gemma3ForConditionalGeneration): Gemma 3's decoder, a SigLIP
vision tower, and a projector that average-pools its patch grid to `mm_tokens_per_image` tokens.

The decoder is `gemma3.Model` over `text_config` (Gemma3TextConfig's defaults filled in), so the
engine sees a Gemma 3 text model; `embed_image` gives one image's soft tokens, which replace the
embeddings of its placeholder tokens (unscaled: only vocabulary embeddings are scaled). The image
tokens attend to each other both ways: the prompt's images say so (`PromptImage.bidirectional`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.models import gemma3
from baselm.models.base import ModelConfigError
from baselm.models.gemma2 import GemmaRMSNorm
from baselm.models.siglip import VisionArgs, VisionModel

# Gemma3TextConfig's defaults, for the keys a checkpoint's text_config may leave out.
TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}


@dataclass
class ModelArgs(gemma3.ModelArgs):
    """Gemma 3's text args (from `text_config`) and the vision tower's (`vision_config`)."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    mm_tokens_per_image: int = 256
    vision: VisionArgs = field(init=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
            raise ModelConfigError("a gemma3 config.json needs a text_config and a vision_config")
        text = {**TEXT_DEFAULTS, **config["text_config"]}
        merged = {
            **text,
            "vision_config": config["vision_config"],
            "mm_tokens_per_image": config.get("mm_tokens_per_image", 256),
        }
        return super().from_dict(merged)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.vision = VisionArgs.from_dict(self.vision_config)

    def validate(self) -> None:
        super().validate()
        side = int(round(self.mm_tokens_per_image**0.5))
        patches = self.vision.patches_per_side
        if side * side != self.mm_tokens_per_image or patches % side:
            raise ModelConfigError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides the "
                f"{patches} patches per side of the vision tower"
            )


class MultiModalProjector(nn.Module):
    """The patch grid average-pooled to tokens_per_side squared, RMS-normed, projected to the decoder's width."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.mm_input_projection_weight = mx.zeros((args.vision.hidden_size, args.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(args.vision.hidden_size, eps=args.vision.layer_norm_eps)
        self.patches_per_side = args.vision.patches_per_side
        self.tokens_per_side = int(round(args.mm_tokens_per_image**0.5))

    def __call__(self, patches: mx.array) -> mx.array:
        """(num_patches, vision_hidden) in row-major grid order -> (mm_tokens_per_image, hidden)."""
        t, hidden = self.tokens_per_side, patches.shape[-1]
        k = self.patches_per_side // t
        pooled = patches.reshape(t, k, t, k, hidden).mean(axis=(1, 3)).reshape(t * t, hidden)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Model(gemma3.Model):
    """Gemma 3's decoder with a SigLIP tower and the pooling projector beside it."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)

    def embed_image(self, pixels: mx.array, extra: dict[str, Any]) -> mx.array:
        """pixels (3, image_size, image_size) -> (mm_tokens_per_image, hidden) soft tokens."""
        return self.multi_modal_projector(self.vision_tower(pixels)).astype(self.embed_tokens.weight.dtype)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Both checkpoint layouts: `model.language_model.*` / `model.vision_tower.*` (transformers 5)
        and `language_model.model.*` / `vision_tower.vision_model.*` (the released checkpoints)."""
        renamed = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            if name.startswith("language_model."):
                name = name.removeprefix("language_model.").removeprefix("model.")
            elif name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
            renamed[name] = value
        return super().sanitize(renamed)
