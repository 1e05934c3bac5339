"""The pixel operations the image processors share, as transformers' Pillow backend does them:
resizing uint8 pixels with one of Pillow's filters, then rescaling and normalizing to float32."""

from __future__ import annotations

from typing import Any

import numpy as np

from baselm.vision.image import ImageError

RESCALE = 1 / 255
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, as Qwen2-VL's processor uses
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Pillow's filter numbers, as preprocessor_config.json gives `resample`.
NEAREST, LANCZOS, BILINEAR, BICUBIC = 0, 1, 2, 3


def resize(pixels: np.ndarray, width: int, height: int, resample: int = BILINEAR) -> np.ndarray:
    """(height, width, 3) uint8: `pixels` (h, w, 3) resized with Pillow's filter `resample`, as
    transformers resizes (an image already of that size is returned as it is)."""
    from PIL import Image as PILImage

    if pixels.shape[1] == width and pixels.shape[0] == height:
        return pixels
    resized = PILImage.fromarray(pixels).resize((width, height), resample=PILImage.Resampling(resample))
    return np.asarray(resized)


def normalize(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(3, height, width) float32 from (height, width, 3) uint8: rescaled by 1/255 in float64, then
    `(x - mean) / std` in float32 (transformers' `rescale` then `normalize`)."""
    scaled = (pixels.astype(np.float64) * RESCALE).astype(np.float32)
    out = (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def mean_and_std(preprocessor: dict[str, Any], mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[tuple, tuple]:
    """A preprocessor config's `image_mean` and `image_std` (three floats each), else the defaults given."""
    got = tuple(preprocessor.get("image_mean") or mean), tuple(preprocessor.get("image_std") or std)
    if any(len(v) != 3 or not all(isinstance(x, (int, float)) for x in v) for v in got) or 0 in got[1]:
        raise ImageError("the model's image_mean and image_std must be three numbers each, the std not zero")
    return tuple(map(float, got[0])), tuple(map(float, got[1]))
