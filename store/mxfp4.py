"""MXFP4 tensors (gpt-oss experts) as HF checkpoints and GGUF files store them, widened to float.

MXFP4 is groups of 32 E2M1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) sharing one
power-of-two scale, an E8M0 exponent biased by 127. Every such value is exact in bfloat16 (and
in float32, which the rare values bfloat16 cannot hold keep).
- HF: `x_blocks` (..., out, in / 32, 16) uint8, two codes a byte (low nibble first), and
  `x_scales` (..., out, in / 32) uint8: MLX's "mxfp4" layout byte for byte. Its float form, as
  transformers makes it, is (..., in, out).
- GGUF (ggml type MXFP4): blocks of 17 bytes, the exponent then 16 bytes whose byte j holds code
  j (low nibble) and code j + 16 (high nibble); rows (..., out, in) like every GGUF matrix.
`.base` has no MXFP4 dtype, so both are widened for `.base` files and the GGUF reader.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError

GGUF_BLOCK_BYTES = 17
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


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


def gguf_mxfp4_record(raw: np.ndarray, shape: tuple[int, ...]) -> TensorRecord:
    """A GGUF MXFP4 tensor's bytes as a float record of `shape` (..., out, in): bf16 when every
    value fits it exactly, else f32."""
    blocks = raw.reshape(-1, GGUF_BLOCK_BYTES)  # (num_blocks, 17)
    exponents = blocks[:, :1].astype(np.int32) - 127  # (num_blocks, 1)
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # (num_blocks, 32): j, then j + 16
    values = np.ldexp(E2M1[codes], exponents).astype(np.float32).reshape(shape)
    bits = values.view(np.uint32)
    if not np.any(bits & np.uint32(0xFFFF)):  # the low half of each float32 is zero: bf16 holds it
        return TensorRecord("bf16", tuple(shape), data=np.ascontiguousarray((bits >> np.uint32(16)).astype(np.uint16)))
    return TensorRecord("f32", tuple(shape), data=np.ascontiguousarray(values))
