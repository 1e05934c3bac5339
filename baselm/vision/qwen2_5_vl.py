"""Qwen2.5-VL's images: any size, resized to whole merged patches within a pixel budget, one
`<|image_pad|>` token per 2 x 2 block of patches.

As transformers' Qwen2VLImageProcessor (Pillow backend) and Qwen2_5_VLProcessor do it: the height
and width are rounded to multiples of patch_size * merge_size (28 for the released models); when
that area exceeds max_pixels both are scaled down (floored), when it falls below min_pixels scaled
up (ceiled), keeping the aspect ratio. The image is resized so (Pillow's bicubic filter), rescaled
by 1/255 and normalized with CLIP's mean and std, then cut into patches listed merge block by
merge block (each row of a block's patches, then the next row), each patch repeated over the
temporal patch size: transformers' (num_patches, 3 * temporal_patch_size * patch_size^2) float32,
kept as (grid_h / merge, grid_w / merge, merge^2, ...) so the patch grid travels with them. The
template's `<|image_pad|>` becomes num_patches / merge_size^2 of them; they attend causally, and
their rotary positions are the model's (M-RoPE: see baselm/models/qwen2_5_vl.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.image import Image, ImageError
from baselm.vision.pixels import BICUBIC, CLIP_MEAN, CLIP_STD, mean_and_std, normalize, resize

IMAGE = "<|image_pad|>"
MAX_ASPECT = 200  # transformers refuses images more elongated than this


class Qwen2_5_VLImageProcessor:
    """Patches and prompt text of one image for a Qwen2.5-VL model."""

    bidirectional = False
    marker = IMAGE

    def __init__(self, config: dict[str, Any], tokenizer: Tokenizer):
        vision = config["vision_config"]
        pre = config.get("preprocessor_config") or {}
        size = pre.get("size") or {}
        self.patch = int(pre.get("patch_size", vision.get("patch_size", 14)))
        self.merge = int(pre.get("merge_size", vision.get("spatial_merge_size", 2)))
        self.temporal = int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2)))
        # a preprocessor's min_pixels / max_pixels win over its size, as in transformers
        self.min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.resample = int(pre.get("resample", BICUBIC))
        self.mean, self.std = mean_and_std(pre, CLIP_MEAN, CLIP_STD)
        if (self.patch, self.merge, self.temporal) != (
            vision.get("patch_size", 14),
            vision.get("spatial_merge_size", 2),
            vision.get("temporal_patch_size", 2),
        ):
            raise ImageError("the model's preprocessor_config.json patch sizes differ from its vision tower's")
        self.placeholder_id = int(config.get("image_token_id", 151655))
        if tokenizer.token_to_id(IMAGE) != self.placeholder_id:
            raise ImageError(f"the config's image_token_id {self.placeholder_id} is not the tokenizer's {IMAGE}")

    def process(self, image: Image) -> tuple[np.ndarray, str]:
        """The patches as (grid_h / merge, grid_w / merge, merge^2, 3 * temporal * patch^2) float32 (so
        the grid travels with them; row-major, they are transformers' pixel_values), and the text."""
        width, height = image.size
        height, width = self.resized_size(height, width)
        pixels = normalize(resize(image.pixels, width, height, self.resample), self.mean, self.std)
        return self._patches(pixels), IMAGE * (height * width // (self.patch * self.merge) ** 2)

    def key(self) -> bytes:
        settings = (self.patch, self.merge, self.temporal, self.min_pixels, self.max_pixels, self.resample)
        return f"qwen2_5_vl:{settings}:{self.mean}:{self.std}".encode()

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: (height, width) in multiples of patch * merge, within the pixel budget."""
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise ImageError(
                f"an image may be at most {MAX_ASPECT} times longer than it is wide; this one is {width}x{height}"
            )
        factor = self.patch * self.merge
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def _patches(self, pixels: np.ndarray) -> np.ndarray:
        """(3, height, width) -> (grid_h / m, grid_w / m, m * m, 3 * temporal * patch^2), m the merge size."""
        channels, height, width = pixels.shape
        p, m = self.patch, self.merge
        grid_h, grid_w = height // p, width // p
        x = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal, p, p))
        return np.ascontiguousarray(x.reshape(grid_h // m, grid_w // m, m * m, channels * self.temporal * p * p))
