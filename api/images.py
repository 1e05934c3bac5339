"""The chat core's image parts: the one owner of "a message part that is an image".

Each protocol reads its own image shape into an `ImageInput` (`from_url`: OpenAI's `image_url`
and Responses' `input_image`, a data URL or an http(s) URL; `from_base64`: Anthropic's base64
source, Ollama's `images`) and puts `image_part(...)` where the image sits among a message's
parts. `prompt_with_images` then does the rest for every protocol, off the event loop: the model
must read images (else a 400 naming it), the count is checked, each image is fetched (http(s),
only with `base serve --allow-image-urls`, within a size and time limit) and decoded (a bad file
is a 400 naming its field, never a 500), the chat template places them, and the model's
processor turns them into the request's `PromptImage`s.
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baselm.api.errors import bad_request
from baselm.api.state import ModelState
from baselm.tokenizer.plain_text import RenderedChat
from baselm.vision import Image, ImageError, PromptImage, decode_image, place_images

FETCH_TIMEOUT = 10.0  # seconds for one image URL, connection and body together


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image as a request gave it: base64 text, or an http(s) URL to fetch; `where` names its field."""

    where: str
    base64: str | None = None
    url: str | None = None


def image_part(image: ImageInput) -> dict[str, Any]:
    """The content part that stands for `image` in a message until the template places it."""
    return {"type": "image", "image": image}


def from_url(value: Any, where: str) -> ImageInput:
    """An image URL: `data:image/...;base64,...`, or http(s) (fetched when the server allows it)."""
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a data: URL or an http(s) URL of an image", where)
    if value.startswith("data:"):
        header, comma, payload = value.partition(",")
        if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise bad_request(f"{where} must be a base64 data URL of an image (data:image/png;base64,...)", where)
        return ImageInput(where, base64=payload)
    if value.startswith(("http://", "https://")):
        return ImageInput(where, url=value)
    raise bad_request(f"{where} must be a data: URL or an http(s) URL of an image", where)


def from_base64(value: Any, where: str) -> ImageInput:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a base64-encoded image", where)
    return ImageInput(where, base64=value)


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The messages as the chat template takes them (each image part a bare `{"type": "image"}`) and
    the images in the order they appear."""
    images: list[ImageInput] = []
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    images.append(p["image"])
                    p = {"type": "image"}
                parts.append(p)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def encode_messages(
    state: ModelState, messages: list[dict[str, Any]], **options: Any
) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids of chat messages (`options`: the template's other arguments) and the images the
    template placed; raises ChatTemplateError for the template's refusal."""
    messages, images = take_images(messages)
    if not images:
        return state.tokenizer.encode_chat(messages, **options), []
    return prompt_with_images(state, state.tokenizer.render_chat(messages, **options), images)


def prompt_with_images(
    state: ModelState, rendered: RenderedChat, images: Sequence[ImageInput]
) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids of `rendered` with `images` placed (through the model's processor), and the
    request's images; a 400 for a model that reads text only, too many images, or one that cannot be read."""
    processor = state.client.engine.image_processor
    if processor is None:
        raise bad_request(f"model {state.model_name} {state.client.engine.image_refusal}", images[0].where)
    limits = state.server.image_limits
    if len(images) > limits.max_images:
        raise bad_request(f"the request has {len(images)} images; the limit is {limits.max_images}", images[0].where)
    decoded = [_decode(state, image) for image in images]
    try:
        return place_images(state.tokenizer, rendered, decoded, processor)
    except ImageError as exc:
        raise bad_request(str(exc), "messages") from None


def _decode(state: ModelState, image: ImageInput) -> Image:
    limits = state.server.image_limits
    data = _fetch(state, image) if image.url is not None else _base64_bytes(image, limits.max_bytes)
    try:
        return decode_image(data, limits, image.where)
    except ImageError as exc:
        raise bad_request(str(exc), image.where) from None


def _base64_bytes(image: ImageInput, max_bytes: int) -> bytes:
    text = image.base64 or ""
    if len(text) // 4 * 3 > max_bytes + 3:
        raise bad_request(f"{image.where} holds more than {max_bytes} bytes; images are limited to that", image.where)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{image.where} is not valid base64", image.where) from None


def _fetch(state: ModelState, image: ImageInput) -> bytes:
    """The bytes at an image URL, at most the byte limit, within FETCH_TIMEOUT seconds."""
    if not state.server.allow_image_urls:
        raise bad_request(
            f"{image.where}: this server does not fetch image URLs; send the image as a data URL "
            "(or start the server with --allow-image-urls)",
            image.where,
        )
    max_bytes = state.server.image_limits.max_bytes
    deadline = time.monotonic() + FETCH_TIMEOUT
    request = urllib.request.Request(image.url, headers={"User-Agent": "base"})
    chunks, size = [], 0
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT) as response:  # noqa: S310 - http(s) only
            while size <= max_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"it took over {FETCH_TIMEOUT:g} seconds")
                chunk = response.read1(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise bad_request(f"{image.where}: the image URL could not be fetched ({_reason(exc)})", image.where) from None
    if size > max_bytes:
        raise bad_request(f"{image.where}: the image is over the limit of {max_bytes} bytes", image.where)
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return " ".join(str(reason).split())[:120] or type(exc).__name__
