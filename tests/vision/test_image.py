"""Decoding image bytes: the four formats, transparency over white, the first GIF frame, and every
bad file refused with an ImageError sentence (seeded fuzzing: truncations, flipped bytes, garbage)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

from baselm.vision import ImageError, ImageLimits, decode_image
from tests.vision_fixture import IMAGE_A, IMAGE_B, png_declaring

RED, BLUE = (220, 30, 30), (30, 30, 220)


def encoded(picture: PILImage.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    picture.save(out, format=fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb_pixels(fmt):
    options = {"lossless": True} if fmt == "WEBP" else {"quality": 95} if fmt == "JPEG" else {}
    image = decode_image(encoded(PILImage.new("RGB", (12, 8), RED), fmt, **options))
    assert image.pixels.shape == (8, 12, 3) and image.pixels.dtype == np.uint8
    assert np.abs(image.pixels.astype(int) - RED).max() <= (3 if fmt == "JPEG" else 0)


def test_a_gif_gives_its_first_frame():
    frames = [PILImage.new("RGB", (6, 6), RED), PILImage.new("RGB", (6, 6), BLUE)]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(data).pixels[0, 0].tolist() == list(RED)


def test_transparency_is_laid_over_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)  # transparent black
    rgba[:2] = (0, 0, 0, 255)  # the top half opaque black
    pixels = decode_image(encoded(PILImage.fromarray(rgba, "RGBA"), "PNG")).pixels
    assert pixels[0, 0].tolist() == [0, 0, 0] and pixels[3, 3].tolist() == [255, 255, 255]


def test_equal_pixels_have_one_digest_whatever_the_file():
    picture = PILImage.new("RGB", (5, 5), BLUE)
    png, gif_like = decode_image(encoded(picture, "PNG")), decode_image(encoded(picture, "WEBP", lossless=True))
    assert png.digest == gif_like.digest
    assert decode_image(IMAGE_A.read_bytes()).digest != decode_image(IMAGE_B.read_bytes()).digest


def test_limits_are_checked_before_decoding():
    with pytest.raises(ImageError, match="is 3000 bytes; images are limited to 1000 bytes"):
        decode_image(bytes(3000), ImageLimits(max_bytes=1000))
    with pytest.raises(ImageError, match="declares 5000x5000 pixels; images are limited to 1000000 pixels"):
        decode_image(png_declaring(5000, 5000), ImageLimits(max_pixels=1_000_000))
    with pytest.raises(ImageError, match="declares too many pixels"):
        decode_image(png_declaring(100_000, 100_000))  # past Pillow's own bomb check


def test_other_formats_are_refused():
    bmp = encoded(PILImage.new("RGB", (4, 4), RED), "BMP")
    with pytest.raises(ImageError, match="could not be read as PNG, JPEG, WebP or GIF"):
        decode_image(bmp)


@pytest.mark.parametrize("source", [IMAGE_A, IMAGE_B], ids=["png", "jpeg"])
def test_fuzzed_files_decode_or_raise_image_error_only(source):
    """Truncations and byte flips of real files, and random garbage: never another exception."""
    data = source.read_bytes()
    rng = np.random.default_rng(7)
    cases = [data[:n] for n in (0, 1, 8, 16, 33, len(data) // 2, len(data) - 1)]
    for _ in range(60):
        flipped = bytearray(data)
        for at in rng.integers(0, len(data), size=4):
            flipped[at] = int(rng.integers(0, 256))
        cases.append(bytes(flipped))
    cases += [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (3, 100, 5000)]
    refused = 0
    for case in cases:
        try:
            image = decode_image(case)
        except ImageError:
            refused += 1
            continue
        assert image.pixels.ndim == 3 and image.pixels.shape[2] == 3
    assert refused >= 7  # every truncation at least
