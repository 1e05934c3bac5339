"""The tiny random Gemma 3 vision-language model of tests/fixtures/models/gemma3_vlm, for tests.

Made by tests/tools/make_vision_fixtures.py with transformers, which also wrote `reference.npz`
(its prompt ids, pixels, logits and greedy ids for the messages below) and the two images.
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from pathlib import Path

import numpy as np

from baselm.backend import select_backend
from baselm.loader import LoadedModel, load_model
from tests.paths import MODEL_FIXTURES

FOLDER: Path = MODEL_FIXTURES / "gemma3_vlm"
IMAGE_A, IMAGE_B = FOLDER / "image_a.png", FOLDER / "image_b.jpg"  # 40x30 RGBA PNG, 50x70 JPEG
PROMPT_1 = "What is in this picture?"  # after one image, as the reference's first prompt has it
# The reference's second prompt: "Compare", image A, "with", image B, in one user message.


@functools.cache
def loaded_vlm() -> LoadedModel:
    return load_model(FOLDER, select_backend("cpu"))


@functools.cache
def reference() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as data:
        return {name: data[name] for name in data.files}


def data_url(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def messages_1(image: dict) -> list[dict]:
    """The reference's first conversation with `image` as the picture part."""
    return [{"role": "user", "content": [image, {"type": "text", "text": PROMPT_1}]}]


def messages_2(image_a: dict, image_b: dict) -> list[dict]:
    text = [{"type": "text", "text": "Compare"}, {"type": "text", "text": "with"}]
    return [{"role": "user", "content": [text[0], image_a, text[1], image_b]}]


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG signature and header that declares `width` x `height` pixels, with one tiny data chunk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + data + chunk(b"IEND", b"")
