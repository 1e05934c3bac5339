"""Images in prompts: decoding (image.py), each model family's preprocessing and prompt layout
(gemma3.py, idefics3.py, qwen2_5_vl.py; pixels.py holds what they share), and the images a request carries
to the engine (prompt.py).

`image_processor` is the one place that says which models read images: a model whose config
names a vision tower this package can prepare images for gets its family's processor; every
other model reads text only.
"""

from __future__ import annotations

from typing import Any

from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.image import Image, ImageError, ImageLimits, decode_image
from baselm.vision.prompt import ImageProcessor, PromptImage, place_images

__all__ = [
    "Image",
    "ImageError",
    "ImageLimits",
    "ImageProcessor",
    "PromptImage",
    "decode_image",
    "image_processor",
    "place_images",
]


def image_processor(config: dict[str, Any], tokenizer: Tokenizer) -> ImageProcessor | None:
    """The image processor of a vision-language model's config; None for a text-only model."""
    if not config.get("vision_config"):
        return None
    model_type = config.get("model_type")
    if model_type == "gemma3":
        from baselm.vision.gemma3 import Gemma3ImageProcessor

        return Gemma3ImageProcessor(config, tokenizer)
    if model_type in ("idefics3", "smolvlm"):
        from baselm.vision.idefics3 import Idefics3ImageProcessor

        return Idefics3ImageProcessor(config, tokenizer)
    if model_type == "qwen2_5_vl":
        from baselm.vision.qwen2_5_vl import Qwen2_5_VLImageProcessor

        return Qwen2_5_VLImageProcessor(config, tokenizer)
    return None
