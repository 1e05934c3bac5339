"""MXFP4 tensors as HF checkpoints store them (gpt-oss experts), widened to float for a `.base` file.

A tensor `x` is stored as `x_blocks` (..., out, in / 32, 16) uint8, two E2M1 codes a byte (low
nibble first), and `x_scales` (..., out, in / 32) uint8 power-of-two exponents biased by 127:
MLX's "mxfp4" layout byte for byte. Its float form, as transformers makes it, is (..., in, out).
Every MXFP4 value is exact in bfloat16, so the widened tensors hold the checkpoint's values.
"""

from __future__ import annotations

import mlx.core as mx

from baselm.store.errors import ModelFileError


def widen_mxfp4(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`weights` with each `x_blocks`/`x_scales` pair replaced by bfloat16 `x` (..., in, out), lazily."""
    widened = dict(weights)
    for name in [n for n in weights if n.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        blocks, scales = widened.pop(name), widened.pop(stem + "_scales", None)
        if scales is None or blocks.dtype != mx.uint8 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise ModelFileError(
                f"{name}: not an MXFP4 tensor (uint8 blocks of 16 bytes with a {stem}_scales of matching shape)"
            )
        codes = blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)  # (..., out, in / 8)
        dense = mx.dequantize(codes, scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.bfloat16)
        widened[stem] = dense.swapaxes(-1, -2)  # (..., in, out)
    return widened
