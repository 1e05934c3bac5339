"""A prompt's images: where the chat template put them, and what the engine carries for each.

The chat template writes one marker per image (`<start_of_image>`, `<image>`, ...: the model's
`ImageProcessor.marker`). `place_images` replaces each marker the template wrote (never one a
message spelled: those are plain text, see tokenizer/plain_text.py) by the text the model's
processor expands it to, encodes the prompt, and finds each image's placeholder tokens in the
ids. The result is one `PromptImage` per image: its preprocessed pixels, the prompt positions
its embeddings replace, and a key naming its content for the prefix cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from baselm.tokenizer.plain_text import RenderedChat
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.image import Image, ImageError


@dataclass(slots=True, eq=False)
class PromptImage:
    """One image of a request: the vision tower's input, the positions its output goes to, its key.

    NOTE: `positions` ascend and are all placeholder tokens of the prompt; the vision tower's
    output for the image has exactly one row per position.
    """

    pixels: np.ndarray  # the processor's output, e.g. (3, height, width) float32
    positions: np.ndarray  # (num_tokens,) int64: prompt positions whose embeddings this image replaces
    key: bytes  # digest of the pixels and how they were processed: equal keys, equal embeddings
    bidirectional: bool = False  # its placeholders attend to each other both ways: a step computes them whole
    embeddings: Any = None  # (num_tokens, hidden) mx.array once the vision tower ran (kept for recompute)
    extra: dict[str, Any] = field(default_factory=dict)  # what a model's tower needs besides pixels

    @property
    def start(self) -> int:
        """The first prompt position of the image's placeholders."""
        return int(self.positions[0])

    @property
    def end(self) -> int:
        """One past the last prompt position of the image's placeholders."""
        return int(self.positions[-1]) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class ImageProcessor(Protocol):
    """A model family's image preprocessing and prompt layout (baselm/vision/<family>.py)."""

    marker: str  # what the chat template writes where an image goes
    placeholder_id: int  # the token id whose embeddings an image's replace
    bidirectional: bool  # the image's placeholders attend to each other both ways

    def process(self, image: Image) -> tuple[np.ndarray, str]:
        """The vision tower's input for `image`, and the text its marker becomes in the prompt."""
        ...

    def key(self) -> bytes:
        """What in the processing changes the pixels (sizes, means): part of every image's key."""
        ...


def place_images(
    tokenizer: Tokenizer, rendered: RenderedChat, images: Sequence[Image], processor: ImageProcessor
) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids of `rendered` with `images` in place of the markers the template wrote, in
    order, and the `PromptImage` of each; an ImageError when the counts differ."""
    starts = _marker_starts(rendered, processor.marker)
    if len(starts) != len(images):
        raise ImageError(
            f"the chat template placed {len(starts)} image(s) but the request has {len(images)}; "
            "put each image in a user message's content"
        )
    processed = [processor.process(image) for image in images]
    ids = tokenizer.encode_prompt(_replace_at(rendered, processor.marker, starts, [text for _, text in processed]))
    where = np.flatnonzero(np.asarray(ids, dtype=np.int64) == processor.placeholder_id)
    prompt_images, taken = [], 0
    processing_key = processor.key()
    for image, (pixels, text) in zip(images, processed):
        num_tokens = text.count(tokenizer.id_to_token(processor.placeholder_id) or "")
        positions = where[taken : taken + num_tokens]
        if len(positions) != num_tokens:
            raise ImageError("the prompt's image placeholders did not encode as the model's image tokens")
        key = hashlib.sha256(image.digest + processing_key).digest()
        prompt_images.append(PromptImage(pixels, positions.astype(np.int64), key, processor.bidirectional))
        taken += num_tokens
    if taken != len(where):
        raise ImageError("the prompt holds image tokens that no image fills; a message may not spell them")
    return ids, prompt_images


def chunk_end(images: Sequence[PromptImage], start: int, end: int, budget: int) -> int:
    """Where a prompt chunk from `start` that would end at `end` ends: never inside the placeholders
    of an image computed whole (bidirectional): before such an image, or past its end when the chunk
    starts inside it and `budget` holds the rest; `start` (nothing this step) when it cannot."""
    for image in images:
        if image.bidirectional and image.start < end < image.end:
            if image.start > start:
                return image.start
            return image.end if image.end - start <= budget else start
    return end


def _marker_starts(rendered: RenderedChat, marker: str) -> list[int]:
    """Offsets of the markers the template wrote: those outside the request's own (plain) text."""
    starts, at = [], rendered.text.find(marker)
    while at >= 0:
        if not any(a <= at < b for a, b in rendered.plain_spans):
            starts.append(at)
        at = rendered.text.find(marker, at + len(marker))
    return starts


def _replace_at(rendered: RenderedChat, marker: str, starts: list[int], texts: list[str]) -> RenderedChat:
    """`rendered` with the marker at each of `starts` replaced by the matching text, its plain spans moved along."""
    pieces, last = [], 0
    for start, text in zip(starts, texts):
        pieces += [rendered.text[last:start], text]
        last = start + len(marker)
    pieces.append(rendered.text[last:])

    def moved(offset: int) -> int:
        return offset + sum(len(t) - len(marker) for s, t in zip(starts, texts) if s < offset)

    return RenderedChat("".join(pieces), tuple((moved(a), moved(b)) for a, b in rendered.plain_spans))
