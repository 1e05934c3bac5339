"""SmolVLM and Idefics3 (HF `smolvlm`, `idefics3`: *ForConditionalGeneration): a Llama decoder, a
SigLIP vision tower run on each frame of an image (its tiles and a global view), and a connector
that pixel-shuffles each frame's patch grid (scale_factor x scale_factor neighbours into one
token) and projects it to the decoder's width.

The decoder is `llama.Model` over `text_config`; `embed_image` gives one image's tokens, frame
after frame, which replace the embeddings of its `<image>` placeholders. The image tokens attend
causally, like text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.models import llama
from baselm.models.base import ModelConfigError
from baselm.models.siglip import VisionArgs, VisionTransformer


@dataclass
class ModelArgs(llama.ModelArgs):
    """The Llama args of `text_config`, the vision tower's (`vision_config`) and the connector's scale."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    scale_factor: int = 2
    vision: VisionArgs = field(init=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text, vision = config.get("text_config"), config.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision, dict):
            raise ModelConfigError(f"a {config.get('model_type')} config.json needs a text_config and a vision_config")
        if text.get("model_type", "llama") != "llama":
            kind = config.get("model_type")
            raise ModelConfigError(f"the text model of {kind} must be llama, not {text['model_type']!r}")
        merged = {
            "rms_norm_eps": 1e-5,  # Idefics3Config's default for its Llama text config
            **text,
            "tie_word_embeddings": config.get("tie_word_embeddings", False),  # the top-level config ties, as in HF
            "vision_config": vision,
            "scale_factor": config.get("scale_factor", 2),
        }
        return super().from_dict(merged)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.vision = VisionArgs.from_dict(self.vision_config)

    def validate(self) -> None:
        super().validate()
        if self.scale_factor < 1 or self.vision.patches_per_side % self.scale_factor:
            raise ModelConfigError(
                f"scale_factor {self.scale_factor} must divide the {self.vision.patches_per_side} patches per side "
                "of the vision tower"
            )


class Connector(nn.Module):
    """Pixel shuffle, then a bias-free projection to the decoder's width (HF's `connector`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.scale_factor = args.scale_factor
        width = args.vision.hidden_size * args.scale_factor**2
        self.modality_projection = {"proj": nn.Linear(width, args.hidden_size, bias=False)}

    def __call__(self, patches: mx.array) -> mx.array:
        """(frames, side * side, vision_hidden), patches row-major -> (frames * tokens, hidden): token
        (i, j) of a frame holds the scale x scale block of patches at (i * scale, j * scale), row by row."""
        frames, num_patches, hidden = patches.shape
        side, s = int(round(num_patches**0.5)), self.scale_factor
        x = patches.reshape(frames, side // s, s, side // s, s, hidden).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(frames * (side // s) ** 2, s * s * hidden)  # (frames * tokens, s * s * hidden)
        return self.modality_projection["proj"](x)


class Model(llama.Model):
    """The Llama decoder with a SigLIP tower and the pixel-shuffle connector beside it."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_model = VisionTransformer(args.vision)
        self.connector = Connector(args)

    def embed_image(self, pixels: mx.array, extra: dict[str, Any]) -> mx.array:
        """pixels (frames, 3, image_size, image_size) -> (frames * tokens_per_frame, hidden)."""
        patches = mx.stack([self.vision_model(frame) for frame in pixels])  # (frames, num_patches, vision_hidden)
        return self.connector(patches).astype(self.embed_tokens.weight.dtype)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF's names: `model.text_model.*`, `model.vision_model.*`, `model.connector.*`, `lm_head.*`."""
        renamed = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            renamed[name.removeprefix("text_model.")] = value
        return super().sanitize(renamed)
