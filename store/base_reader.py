"""Reading a `.base` file: `BaseFile` opens and validates it, then reads tensors on demand as MLX arrays."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
import xxhash

from baselm import gguf_blocks
from baselm.store.base_format import BLOB_ALIGN, FLOAT_DTYPES, PREAMBLE, VERSION, align
from baselm.store.base_header import (
    TensorEntry,
    check_digest,
    check_header,
    check_header_checksum,
    check_layout,
    check_padding,
    parse_header,
    read_preamble,
)
from baselm.store.base_slices import Cut, cut_fits, read_cut
from baselm.store.errors import BaseFileError, SignatureError


class QuantizedArray(NamedTuple):
    """A loaded quantized tensor: MLX's affine triplet plus what `mx.dequantize` needs."""

    codes: mx.array  # (out, in * bits / 32) uint32
    scales: mx.array  # (out, in / group_size)
    biases: mx.array  # (out, in / group_size)
    bits: int
    group_size: int
    shape: tuple[int, int]  # logical (out, in)

    def dequantize(self) -> mx.array:
        return mx.dequantize(self.codes, self.scales, self.biases, group_size=self.group_size, bits=self.bits)


class BlockArray(NamedTuple):
    """A loaded tensor of GGUF blocks (baselm/gguf_blocks.py): the rows' bytes as stored."""

    data: mx.array  # (out, in / block_values * block_bytes) uint8
    dtype: str  # a block dtype: gguf_q8_0, gguf_q4_k ...
    shape: tuple[int, int]  # logical (out, in)

    def dequantize(self) -> mx.array:
        """The float32 values (out, in), as llama.cpp decodes the blocks."""
        return mx.array(gguf_blocks.dequantize(self.dtype, np.array(self.data), self.shape))


Tensor = mx.array | QuantizedArray | BlockArray  # what `read` and `load` give for one tensor


class BaseFile:
    """An opened, validated `.base` file. Tensors are read on demand with `read`/`load`.

    NOTE: `open` checks the whole layout (magic, version, header, every region) before anything
    is trusted; checksums are read and compared only on request (`verify`).
    """

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        tensors: dict[str, TensorEntry],
        blob_start: int,
        version: int = VERSION,
    ) -> None:
        self.path = path
        self.header = header
        self.tensors = tensors
        self.blob_start = blob_start
        self.version = version  # the preamble's: 2 or 3 when the file holds block tensors
        self.bytes_read = 0  # tensor bytes read from the file so far (header and checksums aside)

    @classmethod
    def open(cls, path: str | os.PathLike) -> BaseFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                version, header_len = read_preamble(path, f, file_size)
                header = parse_header(path, f.read(header_len), header_len)
                blob_start = align(PREAMBLE.size + header_len, BLOB_ALIGN)
                check_padding(path, f, PREAMBLE.size + header_len, blob_start, file_size)
        except OSError as exc:
            raise BaseFileError(path, f"it cannot be read ({exc.strerror or exc})") from None
        tensors = check_header(path, header, version)
        check_layout(path, tensors, file_size - blob_start)
        return cls(path, header, tensors, blob_start, version)

    def verify(self) -> None:
        """Checks the header checksum and every region's checksum, streaming; raises on the first mismatch."""
        check_header_checksum(self.path, self.header)
        with self.file() as f:
            for entry in self.tensors.values():
                digest = xxhash.xxh64()
                for chunk in read_chunks(self.path, f, self.blob_start + entry.offset, entry.length):
                    digest.update(chunk)
                check_digest(self.path, entry, digest.hexdigest())

    def read(self, name: str, verify: bool = False) -> Tensor:
        """One tensor as MLX arrays (a float array, a quantized triplet, or a block tensor's bytes)."""
        if name not in self.tensors:
            raise KeyError(f"{self.path} has no tensor named {name!r}")
        with self.file() as f:
            return self._read_entry(f, self.tensors[name], verify)

    def load(
        self,
        verify: bool = False,
        digests: dict[str, str] | None = None,
        cuts: dict[str, list[Cut]] | None = None,
        skip: set[str] | None = None,
    ) -> dict[str, Tensor]:
        """All tensors, in file order. Each region is read once, hashed if asked, then copied into MLX.

        `digests` (tensor name -> SHA-256 hex, a checked signature's): each region's SHA-256 is
        compared as it is read; a mismatch raises before the tensor is used.
        `cuts` (tensor name -> `Cut`s on one axis, in order): those tensors are read as those
        slices alone, joined along the axis, and only their bytes are read. A checksum or digest
        covers a whole region, so a cut goes with neither.
        `skip`: tensors left unread and out of the result."""
        cuts = cuts or {}
        if cuts and (verify or digests is not None):
            raise ValueError("checksums and signatures cover whole regions: sliced reads cannot be checked")
        if verify:
            check_header_checksum(self.path, self.header)
        with self.file() as f:
            tensors = {}
            for name, entry in self.tensors.items():
                if skip and name in skip:
                    continue
                if name in cuts:
                    tensors[name] = self._read_cut(f, entry, cuts[name])
                else:
                    tensors[name] = self._read_entry(f, entry, verify, None if digests is None else digests[name])
            return tensors

    def file(self) -> Any:
        try:
            return open(self.path, "rb")
        except OSError as exc:
            raise BaseFileError(self.path, f"it cannot be read ({exc.strerror or exc})") from None

    def _read_entry(self, f: Any, entry: TensorEntry, verify: bool, sha256: str | None = None) -> Tensor:
        raw = _read_exact(self.path, f, self.blob_start + entry.offset, entry.length)  # (length,) uint8
        if verify:
            check_digest(self.path, entry, xxhash.xxh64(raw).hexdigest())
        if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
            raise SignatureError(f"{self.path}: tensor {entry.name!r} differs from the one that was signed")
        self.bytes_read += entry.length
        if entry.block_type is not None:
            return _blocks(entry, raw, entry.shape)
        if entry.bits is None:
            return _mx_float(raw, entry.dtype, entry.shape)
        out_features, in_features = entry.shape
        codes_len = entry.scale_offset - entry.offset
        scales_len = entry.bias_offset - entry.scale_offset
        groups = (out_features, in_features // entry.group_size)
        codes = raw[:codes_len].view("<u4").reshape(out_features, -1)  # (out, in * bits / 32)
        scales = raw[codes_len : codes_len + scales_len].reshape(groups[0], -1)
        biases = raw[codes_len + scales_len :].reshape(groups[0], -1)
        return _quantized(entry, codes, scales, biases, (out_features, in_features))

    def _read_cut(self, f: Any, entry: TensorEntry, cuts: list[Cut]) -> Tensor:
        if not cuts or any(not cut_fits(entry, cut) or cut.axis != cuts[0].axis for cut in cuts):
            block_type = entry.block_type
            unit = f"{entry.dtype}'s blocks of {block_type.block_values} values" if block_type is not None else "groups"
            raise ValueError(f"{entry.name}: {cuts} do not fit its shape {entry.shape} and {unit} on one axis")
        axis = cuts[0].axis
        parts = [read_cut(self.path, f, self.blob_start, entry, cut) for cut in cuts]
        arrays = parts[0] if len(parts) == 1 else [np.concatenate(same, axis=axis) for same in zip(*parts)]
        self.bytes_read += sum(a.nbytes for a in arrays)
        shape = list(entry.shape)
        shape[axis] = sum(cut.stop - cut.start for cut in cuts)
        if entry.block_type is not None:
            return _blocks(entry, arrays[0], tuple(shape))
        if entry.bits is None:
            return _mx_float(arrays[0], entry.dtype, tuple(shape))
        return _quantized(entry, *arrays, tuple(shape))


def _quantized(
    entry: TensorEntry, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, shape: tuple[int, int]
) -> QuantizedArray:
    """MLX's triplet from the file's arrays: codes (out, words) uint32, scales and biases (out, groups) as stored."""
    groups = (shape[0], shape[1] // entry.group_size)
    return QuantizedArray(
        mx.array(codes),
        _mx_float(scales, entry.scale_dtype, groups),
        _mx_float(biases, entry.scale_dtype, groups),
        entry.bits,
        entry.group_size,
        shape,
    )


def _blocks(entry: TensorEntry, raw: np.ndarray, shape: tuple[int, int]) -> BlockArray:
    """A block tensor of logical `shape` from its rows' bytes as stored (any layout of that many bytes)."""
    rows = raw.reshape(shape[0], gguf_blocks.row_bytes(entry.dtype, shape[1]))  # (out, in / values * block_bytes)
    return BlockArray(mx.array(rows), entry.dtype, shape)


def read_base_file(path: str | os.PathLike, verify: bool = False) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(header, tensors) of a `.base` file, validated first; `verify` also checks every checksum."""
    base = BaseFile.open(path)
    return base.header, base.load(verify=verify)


def model_weights(tensors: dict[str, Tensor]) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Flat weights as the model builder takes them, plus the group size of each quantized prefix.

    A quantized `x.weight` becomes `x.weight` (codes), `x.scales` and `x.biases`; a block tensor
    `x.weight` becomes its uint8 rows under its block type's suffix, `x.q8_0`, `x.q4_k` ... (baselm/gguf_blocks.py).
    """
    weights: dict[str, mx.array] = {}
    group_sizes: dict[str, int] = {}
    for name, value in tensors.items():
        if isinstance(value, QuantizedArray):
            prefix = name.removesuffix(".weight")
            weights |= {
                f"{prefix}.weight": value.codes,
                f"{prefix}.scales": value.scales,
                f"{prefix}.biases": value.biases,
            }
            group_sizes[prefix] = value.group_size
        elif isinstance(value, BlockArray):
            weights[f"{name.removesuffix('.weight')}.{gguf_blocks.BY_DTYPE[value.dtype].suffix}"] = value.data
        else:
            weights[name] = value
    return weights, group_sizes


def _mx_float(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> mx.array:
    values = raw.view(FLOAT_DTYPES[dtype]).reshape(shape)
    array = mx.array(values)
    return array.view(mx.bfloat16) if dtype == "bf16" else array


def _read_exact(path: Path, f: Any, position: int, length: int) -> np.ndarray:
    buffer = np.empty(length, dtype=np.uint8)  # (length,)
    f.seek(position)
    if f.readinto(memoryview(buffer)) != length:
        raise BaseFileError(
            path, f"the file ended while reading bytes {position}..{position + length} (it changed or was truncated)"
        )
    return buffer


def read_chunks(path: Path, f: Any, position: int, length: int, chunk: int = 8 * 1024 * 1024) -> Iterable[bytes]:
    f.seek(position)
    remaining = length
    while remaining:
        data = f.read(min(chunk, remaining))
        if not data:
            raise BaseFileError(
                path,
                f"the file ended while reading bytes {position}..{position + length} (it changed or was truncated)",
            )
        remaining -= len(data)
        yield data
