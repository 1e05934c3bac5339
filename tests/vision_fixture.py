"""The tiny random vision-language models of tests/fixtures/models/*_vlm, for tests.

Each was made with transformers by a generator in tests/tools/ (make_vision_fixtures.py for Gemma 3,
make_idefics3_fixture.py, ...), which also wrote `reference.npz` (its prompt ids, pixels, logits and
greedy ids for the two conversations below) and the images. `VisionFixture` is one of them; the
module-level names are the Gemma 3 one's.
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from baselm.backend import select_backend
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.loader import LoadedModel, load_model
from baselm.models.base import ImageEmbeddings
from baselm.vision import ImageProcessor, PromptImage, decode_image, image_processor, place_images
from tests.paths import MODEL_FIXTURES

FOLDER: Path = MODEL_FIXTURES / "gemma3_vlm"
IMAGE_A, IMAGE_B = FOLDER / "image_a.png", FOLDER / "image_b.jpg"  # 40x30 RGBA PNG, 50x70 JPEG
PROMPT_1 = "What is in this picture?"  # after one image, as the reference's first prompt has it
# The reference's second prompt: "Compare", image A, "with", image B, in one user message.


def loaded_vlm() -> LoadedModel:
    return _loaded(FOLDER)


def reference() -> dict[str, np.ndarray]:
    return _reference(FOLDER)


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


@dataclass(frozen=True)
class VisionFixture:
    """One fixture folder: its model, transformers' reference, and the images of its two prompts."""

    name: str
    images_1: tuple[str, ...]  # file names of prompt "1"'s image
    images_2: tuple[str, ...]  # prompt "2"'s two images

    @property
    def folder(self) -> Path:
        return MODEL_FIXTURES / self.name

    def loaded(self) -> LoadedModel:
        return _loaded(self.folder)

    def reference(self) -> dict[str, np.ndarray]:
        return _reference(self.folder)

    def paths(self, tag: str) -> list[Path]:
        return [self.folder / n for n in (self.images_1 if tag == "1" else self.images_2)]

    def prompt(self, tag: str, processor: ImageProcessor | None = None) -> tuple[list[int], list[PromptImage]]:
        """The reference's prompt `tag` through our chat template and the model's processor."""
        loaded = self.loaded()
        processor = processor or image_processor(loaded.config, loaded.tokenizer)
        image = {"type": "image"}
        messages = messages_1(image) if tag == "1" else messages_2(image, image)
        images = [decode_image(p.read_bytes()) for p in self.paths(tag)]
        return place_images(loaded.tokenizer, loaded.tokenizer.render_chat(messages), images, processor)

    def logits(self, ids: list[int], images: list[PromptImage], block_size: int = 4) -> np.ndarray:
        """One forward over the whole prompt through a fresh paged cache: (len(ids), vocab)."""
        return prompt_logits(self.loaded().model, ids, images, block_size)


def prompt_logits(model, ids: list[int], images: list[PromptImage], block_size: int = 4) -> np.ndarray:
    """`model`'s logits at every position of `ids` with `images` in place, through a fresh paged cache
    whose blocks are handed out in reverse: (len(ids), vocab)."""
    num_blocks = -(-len(ids) // block_size)
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size)
    spans = [[(i.start, i.end) for i in images if i.bidirectional]]
    meta = AttentionMetadata.build(
        [list(range(num_blocks))[::-1]], [len(ids)], [len(ids)], block_size, two_way_spans=spans
    )
    rows = mx.array(np.concatenate([i.positions for i in images]).astype(np.int32))
    embeddings = mx.concatenate([model.embed_image(mx.array(i.pixels), i.extra) for i in images])
    positions = meta.positions if model.position_rows == 1 else mx.array(model.rope_positions(len(ids), images)[0])
    return np.array(model(mx.array(ids), positions, meta, cache, images=ImageEmbeddings(rows, embeddings)))


@functools.cache
def _loaded(folder: Path) -> LoadedModel:
    return load_model(folder, select_backend("cpu"))


@functools.cache
def _reference(folder: Path) -> dict[str, np.ndarray]:
    with np.load(folder / "reference.npz") as data:
        return {name: data[name] for name in data.files}


GEMMA3 = VisionFixture("gemma3_vlm", ("image_a.png",), ("image_a.png", "image_b.jpg"))
IDEFICS3 = VisionFixture("idefics3_vlm", ("image_a.png",), ("image_b.jpg", "image_c.png"))
QWEN2_5_VL = VisionFixture("qwen2_5_vl", ("image_a.png",), ("image_b.jpg", "image_c.png"))
