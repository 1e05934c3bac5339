"""GGUF blocks kept as they are: the one description of them that the GGUF reader, the `.base`
format and the models share.

A block tensor of shape (out, in) is `out` rows of `in / block_values` blocks, each the bytes
llama.cpp writes: the blocks of 32 values (ggml's `block_q4_0`, `block_q4_1`, `block_q5_0`,
`block_q5_1`, `block_q8_0`, `block_iq4_nl`: the "legacy" family) and the super-blocks of 256
(`block_q2_K`, `block_q3_K`, `block_q4_K`, `block_q5_K`, `block_q6_K`, `block_iq4_xs`). Kept whole,
a row is `in / block_values * block_bytes` uint8 values, and the CPU kernels (`baselm.cpu`:
csrc/legacy_blocks_impl.h, csrc/kquants_impl.h) decode them as they stream through the matmul:
nothing is converted when a file loads, and the weights take the bytes llama.cpp's do (Q2_K 2.625
bits a weight, Q3_K 3.4375, Q4_0 4.5, IQ4_NL 4.5, IQ4_XS 4.25, Q5_0 5.5, Q8_0 8.5, Q4_K 4.5, Q6_K
6.5625).

In memory a kept tensor is one uint8 array `(out, in / block_values * block_bytes)` under the name
`<module path>.<suffix>` (`model.layers.0.mlp.down_proj.q6_k`), in place of the `.weight` (and
`.scales`/`.biases`) of a float or affine one; in a `.base` file it is one region of dtype
`gguf_<suffix>` (`gguf_q8_0`) holding those bytes. The CPU kernels' layers take a legacy type's rows
in the runs layout (RUNS_OFFSET below), rewritten once as the model loads.
"""

from __future__ import annotations

import os
from typing import NamedTuple

SUPER_BLOCK = 256  # values a super-block (the K-quants', IQ4_XS's) holds
LEGACY_BLOCK = 32  # values a legacy block holds


class BlockType(NamedTuple):
    gguf_type: str  # GGMLQuantizationType name
    dtype: str  # the `.base` dtype
    suffix: str  # the weight name's suffix in memory, and the kernels' name for it
    block_values: int  # values a block holds
    block_bytes: int  # bytes a block takes
    kernel_kind: int  # the CPU kernels' BlockType enum value (csrc/kernels.h)
    base_version: int  # the `.base` version that first holds this dtype

    @property
    def is_kquant(self) -> bool:
        """Whether its blocks are super-blocks of 256 (the K-quants and IQ4_XS), which keep the
        file's layout in memory; the legacy blocks of 32 are taken in the runs layout."""
        return self.block_values == SUPER_BLOCK

    def kernel_name(self, runs: bool) -> str:
        """The kernels' name for these blocks, in the file's layout or (a legacy type) the runs layout."""
        return f"{self.suffix}_runs" if runs else self.suffix

    def kernel_enum(self, runs: bool) -> int:
        """The kernels' BlockType value (csrc/kernels.h) for these blocks in either layout."""
        return self.kernel_kind + (RUNS_OFFSET if runs else 0)


BLOCK_TYPES = (
    BlockType("Q4_0", "gguf_q4_0", "q4_0", LEGACY_BLOCK, 18, 110, 3),
    BlockType("Q4_1", "gguf_q4_1", "q4_1", LEGACY_BLOCK, 20, 111, 3),
    BlockType("Q5_0", "gguf_q5_0", "q5_0", LEGACY_BLOCK, 22, 112, 3),
    BlockType("Q5_1", "gguf_q5_1", "q5_1", LEGACY_BLOCK, 24, 113, 3),
    BlockType("Q8_0", "gguf_q8_0", "q8_0", LEGACY_BLOCK, 34, 118, 3),
    BlockType("IQ4_NL", "gguf_iq4_nl", "iq4_nl", LEGACY_BLOCK, 18, 114, 4),
    BlockType("Q2_K", "gguf_q2_k", "q2_k", SUPER_BLOCK, 84, 102, 4),
    BlockType("Q3_K", "gguf_q3_k", "q3_k", SUPER_BLOCK, 110, 103, 4),
    BlockType("Q4_K", "gguf_q4_k", "q4_k", SUPER_BLOCK, 144, 104, 2),
    BlockType("Q5_K", "gguf_q5_k", "q5_k", SUPER_BLOCK, 176, 105, 2),
    BlockType("Q6_K", "gguf_q6_k", "q6_k", SUPER_BLOCK, 210, 106, 2),
    BlockType("IQ4_XS", "gguf_iq4_xs", "iq4_xs", SUPER_BLOCK, 136, 107, 4),
)
# The kernels' legacy types in the runs layout (csrc/kernels.h's kQ*Runs, made by
# `cpu.kernels.block_runs`): each full run of 8 blocks field by field, so that a run's scales load
# as one vector. Their kind is the suffix + "_runs", their enum value the file's + RUNS_OFFSET.
RUNS_OFFSET = 10
BY_GGUF_TYPE = {t.gguf_type: t for t in BLOCK_TYPES}
BY_DTYPE = {t.dtype: t for t in BLOCK_TYPES}
BY_SUFFIX = {t.suffix: t for t in BLOCK_TYPES}
KQUANT_TYPES = frozenset(t.gguf_type for t in BLOCK_TYPES if t.gguf_type.endswith("_K"))  # BASE_KQUANT_BLOCKS
# The types kept by default where the kernels have SIMD loops for them: every type. Most run at least
# as fast as their affine form there; Q2_K, Q3_K, IQ4_NL and IQ4_XS are slower per one-row matmul but
# kept for what the file holds: Q2_K's affine form is a re-quantization, the others' exact forms take
# 2-2.6x the bytes (docs/measurements.md).
DEFAULT_KEPT = frozenset(BY_GGUF_TYPE)


class BlockSettingError(ValueError):
    """BASE_GGUF_BLOCKS names something that is not a block type."""


def kept_on_load(isa: str) -> frozenset[str]:
    """The GGUF types whose matrices `base run`/`serve` of a GGUF (or of a `.base` pulled from one)
    keep as blocks on CPU kernels of instruction set `isa`; the others load in the affine form.

    By default DEFAULT_KEPT where the kernels have SIMD loops for them (avx2, avx512), none on the
    generic build (its plain loops over K-quant blocks ran a 1.5B file at a third of the affine
    form's speed). `BASE_GGUF_BLOCKS=1` keeps every type, `=0` none, and a list such as
    `q5_0,q8_0` those types; `BASE_KQUANT_BLOCKS=1`/`=0`, its older spelling, turns the K-quant
    types alone on or off where BASE_GGUF_BLOCKS is not set."""
    setting = os.environ.get("BASE_GGUF_BLOCKS", "").strip()
    if setting:
        return _named_types(setting)
    default = DEFAULT_KEPT if isa != "generic" else frozenset()
    kquants = os.environ.get("BASE_KQUANT_BLOCKS")
    if kquants in ("0", "1"):
        return (default - KQUANT_TYPES) | (KQUANT_TYPES if kquants == "1" else frozenset())
    return default


def _named_types(setting: str) -> frozenset[str]:
    """The GGUF types a BASE_GGUF_BLOCKS value names: 1 (all), 0 (none) or a comma-separated list."""
    if setting in ("0", "1"):
        return frozenset(BY_GGUF_TYPE) if setting == "1" else frozenset()
    names = {name.strip().upper() for name in setting.split(",") if name.strip()}
    unknown = sorted(names - set(BY_GGUF_TYPE))
    if unknown:
        raise BlockSettingError(
            f"BASE_GGUF_BLOCKS={setting} names {', '.join(unknown)}, which is not a block type; use 1, 0 or "
            f"a list of {', '.join(t.suffix for t in BLOCK_TYPES)}"
        )
    return frozenset(names)


def row_bytes(dtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` values (a multiple of the block's values) in `dtype`'s blocks."""
    block = BY_DTYPE[dtype]
    if in_features % block.block_values:
        raise ValueError(f"{dtype} rows hold whole blocks of {block.block_values} values, not {in_features}")
    return in_features // block.block_values * block.block_bytes


def in_features(dtype: str, num_row_bytes: int) -> int:
    """The values in a row of `num_row_bytes` bytes of `dtype`'s blocks."""
    block = BY_DTYPE[dtype]
    blocks, rem = divmod(num_row_bytes, block.block_bytes)
    if rem or not blocks:
        raise ValueError(f"a {dtype} row of {num_row_bytes} bytes is not whole {block.block_bytes}-byte blocks")
    return blocks * block.block_values


def split_name(name: str) -> tuple[str, BlockType] | None:
    """(module path, block type) of an in-memory kept block weight's name, else None."""
    prefix, _, suffix = name.rpartition(".")
    block_type = BY_SUFFIX.get(suffix)
    return (prefix, block_type) if prefix and block_type else None


def dequantize(dtype: str, data, shape: tuple[int, int]):
    """The float32 values (out, in) of a kept tensor's blocks, as llama.cpp decodes them."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(shape[0], row_bytes(dtype, shape[1]))
    values = gguf_dequantize(raw, GGMLQuantizationType[BY_DTYPE[dtype].gguf_type])
    return np.asarray(values, dtype=np.float32).reshape(shape)
