"""Image bytes in, RGB pixels out: the one place an image file is opened.

Only PNG, JPEG, WebP and GIF (its first frame) are read, with Pillow. The file's declared size
is checked against `ImageLimits.max_pixels` before any pixel is decoded, so a small file that
declares a huge image (a decompression bomb) is refused without the memory it would take; a
truncated, corrupt or unknown file is refused with one `ImageError` sentence, never another
exception. Transparency is laid over white and EXIF orientation applied, as transformers'
image loading does, so pixels match what a model's own processor would see.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}


class ImageError(ValueError):
    """An image that cannot be read: not one of the formats, corrupt, truncated, or over a limit."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may send: bytes per image, pixels per image, and images in all."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000  # declared width * height (an 8K photo is 33 million)
    max_images: int = 16


@dataclass(frozen=True, slots=True)
class Image:
    """One decoded image: its RGB pixels and a digest of them (what the prefix cache keys it by)."""

    pixels: np.ndarray  # (height, width, 3) uint8
    digest: bytes  # sha256 over the shape and the pixels

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as Pillow gives it."""
        return self.pixels.shape[1], self.pixels.shape[0]

    @classmethod
    def of_pixels(cls, pixels: np.ndarray) -> Image:
        pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
        if pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
            raise ImageError(f"an image must be (height, width, 3) RGB pixels, not {pixels.shape}")
        h = hashlib.sha256(np.asarray(pixels.shape, dtype=np.int64).tobytes())
        h.update(pixels.tobytes())
        return cls(pixels, h.digest())


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), what: str = "the image") -> Image:
    """The RGB pixels of an encoded image; raises ImageError naming `what` when it cannot be read."""
    from PIL import Image as PILImage  # Pillow: only where an image arrives

    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} is {len(data)} bytes; images are limited to {limits.max_bytes} bytes")
    if not data:
        raise ImageError(f"{what} is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            picture = PILImage.open(io.BytesIO(data), formats=FORMATS)
            width, height = picture.size
            if width * height > limits.max_pixels:
                raise ImageError(
                    f"{what} declares {width}x{height} pixels; images are limited to {limits.max_pixels} pixels"
                )
            picture.seek(0)  # a GIF's (or an animated WebP's) first frame
            picture.load()
            return Image.of_pixels(np.asarray(_upright_rgb(picture)))
    except ImageError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):  # past Pillow's own limit
        raise ImageError(f"{what} declares too many pixels; images are limited to {limits.max_pixels} pixels") from None
    except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise many kinds; each is a bad file
        raise ImageError(f"{what} could not be read as PNG, JPEG, WebP or GIF ({_reason(exc)})") from None


def _upright_rgb(picture):  # PIL.Image.Image -> PIL.Image.Image
    """RGB pixels the right way up: EXIF orientation applied, transparency laid over white."""
    from PIL import Image as PILImage
    from PIL import ImageOps

    picture = ImageOps.exif_transpose(picture) or picture
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        rgba = picture.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return picture.convert("RGB")


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())[:120]
    return text or type(exc).__name__
