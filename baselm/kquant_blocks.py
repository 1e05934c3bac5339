"""GGUF K-quant blocks kept as they are: the one description of them that the GGUF reader, the
`.base` format and the models share.

A K-quant tensor of shape (out, in) is `out` rows of `in / 256` super-blocks, each block the
bytes llama.cpp writes (ggml's `block_q4_K`, `block_q5_K`, `block_q6_K`). Kept whole, a row is
`in / 256 * block_bytes` uint8 values, and the CPU kernels (`baselm.cpu`, csrc/kquants_impl.h)
decode them as they stream through the matmul: nothing is converted when a file loads, and the
weights take the bytes llama.cpp's do (Q4_K 4.5 bits a weight, Q6_K 6.5625).

In memory a kept tensor is one uint8 array `(out, in / 256 * block_bytes)` under the name
`<module path>.<suffix>` (`model.layers.0.mlp.down_proj.q6_k`), in place of the `.weight`
(and `.scales`/`.biases`) of a float or affine one; in a `.base` file it is one region of
dtype `gguf_q4_k` | `gguf_q5_k` | `gguf_q6_k` holding those bytes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

SUPER_BLOCK = 256


class BlockType(NamedTuple):
    gguf_type: str  # GGMLQuantizationType name
    dtype: str  # the `.base` dtype
    suffix: str  # the weight name's suffix in memory
    block_bytes: int  # bytes per super-block of 256 values
    kernel_kind: int  # the CPU kernels' Quant enum value (csrc/kernels.h)


BLOCK_TYPES = (
    BlockType("Q4_K", "gguf_q4_k", "q4_k", 144, 104),
    BlockType("Q5_K", "gguf_q5_k", "q5_k", 176, 105),
    BlockType("Q6_K", "gguf_q6_k", "q6_k", 210, 106),
)
BY_GGUF_TYPE = {t.gguf_type: t for t in BLOCK_TYPES}
BY_DTYPE = {t.dtype: t for t in BLOCK_TYPES}
BY_SUFFIX = {t.suffix: t for t in BLOCK_TYPES}


def kept_on_load(isa: str) -> bool:
    """Whether `base run`/`serve` of a GGUF file keep its K-quant matrices as blocks on CPU kernels of
    instruction set `isa`: by default where they have SIMD loops for them (avx2, avx512), and as
    `BASE_KQUANT_BLOCKS=1`/`=0` says. Kept, they take the bytes llama.cpp's do, load with nothing
    converted and lose nothing to re-quantization; one stream and prefill run faster than on the affine
    form, 8 streams about a tenth slower (docs/measurements.md), and the generic build's plain loops over
    them a third of the affine form's speed. Off, Q4_K/Q5_K load as exact affine triplets and Q6_K is
    re-quantized to 8 bits."""
    setting = os.environ.get("BASE_KQUANT_BLOCKS")
    return setting == "1" if setting in ("0", "1") else isa != "generic"


def row_bytes(dtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` values (a multiple of 256) in `dtype`'s blocks."""
    if in_features % SUPER_BLOCK:
        raise ValueError(f"{dtype} rows hold whole blocks of {SUPER_BLOCK} values, not {in_features}")
    return in_features // SUPER_BLOCK * BY_DTYPE[dtype].block_bytes


def in_features(dtype: str, num_row_bytes: int) -> int:
    """The values in a row of `num_row_bytes` bytes of `dtype`'s blocks."""
    blocks, rem = divmod(num_row_bytes, BY_DTYPE[dtype].block_bytes)
    if rem or not blocks:
        raise ValueError(
            f"a {dtype} row of {num_row_bytes} bytes is not whole {BY_DTYPE[dtype].block_bytes}-byte blocks"
        )
    return blocks * SUPER_BLOCK


def split_name(name: str) -> tuple[str, BlockType] | None:
    """(module path, block type) of an in-memory kept K-quant weight's name, else None."""
    prefix, _, suffix = name.rpartition(".")
    block_type = BY_SUFFIX.get(suffix)
    return (prefix, block_type) if prefix and block_type else None


def block_values(dtype: str, data, shape: tuple[int, int]):
    """The float32 values (out, in) of a kept tensor's blocks, as llama.cpp decodes them."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(shape[0], row_bytes(dtype, shape[1]))
    values = dequantize(raw, GGMLQuantizationType[BY_DTYPE[dtype].gguf_type])
    return np.asarray(values, dtype=np.float32).reshape(shape)
