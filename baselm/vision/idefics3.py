"""SmolVLM's and Idefics3's images: tiles of the tower's size plus a global view, each frame
`image_seq_len` tokens between `<fake_token_around_image>` markers.

As transformers' Idefics3ImageProcessor (Pillow backend) and Idefics3Processor / SmolVLMProcessor
do it: the image is resized (Pillow's filter `resample`, Lanczos by default) so its longest edge is
`size.longest_edge` (the other edge rounded down, then up to even), then up to whole multiples of
the tile size (`max_image_size.longest_edge`); an image larger than one tile is cut into rows x
cols tiles, row by row, and a global view (the whole resized image shrunk to one tile) follows.
Each frame is rescaled by 1/255 and normalized with `image_mean` and `image_std`. The template's
`<image>` becomes, per tile, `<fake_token_around_image><row_R_col_C>` + the frame's `<image>`
tokens, a newline after each row, then "\\n" + `<fake_token_around_image><global-img>` + the
global frame's tokens + `<fake_token_around_image>` (an image of one tile is only the global part).
The settings come from the folder's preprocessor_config.json (kept in the config as
`preprocessor_config`), with transformers' defaults where it is absent.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.image import Image, ImageError
from baselm.vision.pixels import LANCZOS, mean_and_std, normalize, resize

MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized image's longest edge
IMAGE, FAKE, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"


class Idefics3ImageProcessor:
    """Frames and prompt text of one image for a SmolVLM / Idefics3 model."""

    bidirectional = False
    marker = IMAGE

    def __init__(self, config: dict[str, Any], tokenizer: Tokenizer):
        vision = config["vision_config"]
        pre = config.get("preprocessor_config") or {}
        self.tile = int((pre.get("max_image_size") or {}).get("longest_edge", vision["image_size"]))
        self.longest_edge = int((pre.get("size") or {}).get("longest_edge", 4 * self.tile))
        self.splits = bool(pre.get("do_image_splitting", True))
        self.resample = int(pre.get("resample", LANCZOS))
        self.mean, self.std = mean_and_std(pre, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        if self.tile != vision["image_size"]:
            raise ImageError(
                f"the model's tiles are {self.tile} pixels but its vision tower takes {vision['image_size']}; "
                "its preprocessor_config.json does not fit it"
            )
        per_side = vision["image_size"] // vision["patch_size"] // int(config.get("scale_factor", 2))
        self.num_tokens = per_side * per_side  # tokens per frame
        self.placeholder_id = int(config.get("image_token_id", 128257))
        for token in (IMAGE, FAKE, GLOBAL):
            if tokenizer.token_to_id(token) is None:
                raise ImageError(f"the model's vocabulary lacks {token}; its tokenizer does not fit it")
        if tokenizer.token_to_id(IMAGE) != self.placeholder_id:
            raise ImageError(f"the config's image_token_id {self.placeholder_id} is not the tokenizer's {IMAGE}")

    def process(self, image: Image) -> tuple[np.ndarray, str]:
        """(frames, 3, tile, tile) float32 pixels (tiles row by row, then the global view), and the text."""
        width, height = image.size
        height, width = _longest_edge_to(height, width, self.longest_edge)
        pixels = resize(image.pixels, width, height, self.resample)
        if not self.splits:
            return self._frames([resize(pixels, self.tile, self.tile, self.resample)]), self._global_text()
        height, width = _whole_tiles(height, width, self.tile)
        pixels = resize(pixels, width, height, self.resample)
        if height <= self.tile and width <= self.tile:
            return self._frames([pixels]), self._global_text()
        rows, cols = height // self.tile, width // self.tile
        t = self.tile
        tiles = [pixels[r * t : (r + 1) * t, c * t : (c + 1) * t] for r in range(rows) for c in range(cols)]
        frames = self._frames([*tiles, resize(pixels, t, t, self.resample)])
        return frames, self._tiles_text(rows, cols) + "\n" + self._global_text()

    def key(self) -> bytes:
        settings = (self.tile, self.longest_edge, self.splits, self.resample, self.mean, self.std)
        return f"idefics3:{settings}".encode()

    def _frames(self, frames: list[np.ndarray]) -> np.ndarray:
        return np.stack([normalize(np.ascontiguousarray(f), self.mean, self.std) for f in frames])

    def _global_text(self) -> str:
        return f"{FAKE}{GLOBAL}{IMAGE * self.num_tokens}{FAKE}"

    def _tiles_text(self, rows: int, cols: int) -> str:
        lines = [
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE * self.num_tokens}" for c in range(cols)) + "\n"
            for r in range(rows)
        ]
        return "".join(lines)


def _longest_edge_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge `longest`, the other rounded down then up to even, and
    both within MAX_IMAGE_SIZE (transformers' two resize rules, in their float arithmetic)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to whole tiles, the shorter edge through the aspect ratio first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
