"""Gemma 3's images: one square resize, pixels scaled to [-1, 1], 256 soft tokens between markers.

As transformers' Gemma3ImageProcessor (Pillow backend) and Gemma3Processor do it, without pan and
scan: the image is resized to the vision tower's size with Pillow's bilinear filter, rescaled by
1/255 (in float64, then float32) and normalized with mean 0.5 and std 0.5; the template's
`<start_of_image>` becomes "\\n\\n<start_of_image>" + `mm_tokens_per_image` image tokens +
"<end_of_image>\\n\\n". The image tokens attend to each other both ways (the model's mask).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.image import Image, ImageError
from baselm.vision.pixels import normalize, resize

MEAN = STD = (0.5, 0.5, 0.5)


class Gemma3ImageProcessor:
    """Pixels and prompt text of one image for a Gemma 3 model (config: `Gemma3Config`'s keys)."""

    bidirectional = True

    def __init__(self, config: dict[str, Any], tokenizer: Tokenizer):
        self.size = int(config["vision_config"]["image_size"])
        self.num_tokens = int(config.get("mm_tokens_per_image", 256))
        self.placeholder_id = int(config.get("image_token_index", config.get("image_token_id", 262144)))
        names = [
            tokenizer.id_to_token(int(config.get(key, default)))
            for key, default in (("boi_token_index", 255999), ("eoi_token_index", 256000))
        ]
        image_token = tokenizer.id_to_token(self.placeholder_id)
        if None in names or image_token is None:
            raise ImageError("the model's vocabulary lacks Gemma 3's image tokens; its tokenizer does not fit it")
        self.marker, end = names
        self._text = f"\n\n{self.marker}{image_token * self.num_tokens}{end}\n\n"

    def process(self, image: Image) -> tuple[np.ndarray, str]:
        """(3, size, size) float32 pixels, and the marker's expansion."""
        return normalize(resize(image.pixels, self.size, self.size), MEAN, STD), self._text

    def key(self) -> bytes:
        return f"gemma3:{self.size}".encode()
