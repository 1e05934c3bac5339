"""Reading one slice of a `.base` tensor without reading the rest of its region.

A `Cut` keeps output rows [start, stop) (axis -2) or input columns [start, stop) (axis -1) of a
tensor's logical shape (`BaseFile.load` reads several on one axis and joins them: a fused
tensor's parts). Regions are row-major, so:
- a row cut of a 2-D tensor is one contiguous range of each sub-region (codes, scales, biases);
- a column cut is one range per row of each sub-region.
A block tensor (`gguf_q8_0`, `gguf_q4_k` ...) is one region of rows of blocks (32 or 256 values): a
row cut takes whole rows, a column cut whole blocks (columns on block boundaries, a byte range of
each row).
Each sub-region is mapped (`mmap`), the window copied out, and the mapping closed before the next,
so the process never holds more than one region's mapping.

NOTE: what a column cut costs at page granularity: the kernel pages in every page a row's window
touches. A row of a small layer is shorter than a page (SmolLM2's down_proj codes: 768 bytes a
row at 4 bits), so a column cut then pages the whole region into the page cache, though only the
window is copied into the process. Rows of a page or more (large models: 8192 inputs at 4 bits
are 4 KiB a row) page in about the window alone.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from baselm import gguf_blocks
from baselm.store.base_format import FLOAT_DTYPES
from baselm.store.base_header import TensorEntry
from baselm.store.errors import BaseFileError


class Cut(NamedTuple):
    """Logical rows (axis -2) or columns (axis -1) [start, stop) of a tensor to read."""

    axis: int
    start: int
    stop: int


def cut_fits(entry: TensorEntry, cut: Cut) -> bool:
    """Whether `cut` can be read from `entry` as stored: inside its shape, and for a quantized
    tensor's columns on its quantization groups (codes are then whole uint32 words), for a block
    tensor's on its blocks."""
    if len(entry.shape) < 2 or cut.axis not in (-1, -2) or not 0 <= cut.start < cut.stop <= entry.shape[cut.axis]:
        return False
    if cut.axis == -2 or (entry.bits is None and entry.block_type is None):
        return True
    unit = entry.group_size if entry.block_type is None else entry.block_type.block_values
    return cut.start % unit == 0 and cut.stop % unit == 0


def read_cut(path: Path, f: Any, blob_start: int, entry: TensorEntry, cut: Cut) -> list[np.ndarray]:
    """The cut of `entry`'s arrays, copied from the file: [values] of a float tensor, [codes,
    scales, biases] of a quantized one (scales and biases as stored: raw `FLOAT_DTYPES`), [bytes]
    of a block tensor (uint8 rows of whole blocks)."""
    position = blob_start + entry.offset
    if entry.block_type is not None:
        out_features, in_features = entry.shape
        row_bytes = gguf_blocks.row_bytes(entry.dtype, in_features)
        byte_cut = _scaled(cut, entry.block_type.block_bytes, entry.block_type.block_values)
        return [_window(path, f, position, np.dtype(np.uint8), (out_features, row_bytes), byte_cut)]
    if entry.bits is None:
        return [_window(path, f, position, FLOAT_DTYPES[entry.dtype], entry.shape, cut)]
    out_features, in_features = entry.shape
    words, groups = in_features * entry.bits // 32, in_features // entry.group_size
    codes_len, scales_len = entry.scale_offset - entry.offset, entry.bias_offset - entry.scale_offset
    group_cut, scale_dtype = _scaled(cut, 1, entry.group_size), FLOAT_DTYPES[entry.scale_dtype]
    return [
        _window(path, f, position, np.dtype("<u4"), (out_features, words), _scaled(cut, entry.bits, 32)),
        _window(path, f, position + codes_len, scale_dtype, (out_features, groups), group_cut),
        _window(path, f, position + codes_len + scales_len, scale_dtype, (out_features, groups), group_cut),
    ]


def _scaled(cut: Cut, numerator: int, denominator: int) -> Cut:
    """A column cut in another unit (code words, groups, block bytes); row cuts keep their rows."""
    if cut.axis == -2:
        return cut
    return Cut(cut.axis, cut.start * numerator // denominator, cut.stop * numerator // denominator)


def _window(path: Path, f: Any, position: int, dtype: np.dtype, shape: tuple[int, ...], cut: Cut) -> np.ndarray:
    """The cut of the row-major array `shape` of `dtype` stored at file offset `position`, copied out."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    start = position - position % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(f.fileno(), position - start + nbytes, offset=start, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise BaseFileError(path, f"bytes {position}..{position + nbytes} cannot be mapped ({exc})") from None
    try:
        whole = np.frombuffer(mapped, dtype=dtype, count=nbytes // dtype.itemsize, offset=position - start)
        whole = whole.reshape(shape)
        window = whole[..., cut.start : cut.stop, :] if cut.axis == -2 else whole[..., cut.start : cut.stop]
        copied = np.array(window, copy=True)  # (..., rows, columns) of the cut only, off the mapping
        del whole, window  # no view may outlive the mapping
    finally:
        mapped.close()
    return copied
