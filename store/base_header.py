"""Validation of a `.base` file before anything in it is trusted: preamble, header, tensor table, layout.

Every check ends in a `BaseFileError` that names the file and the one thing wrong with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselm import gguf_blocks
from baselm.store.base_format import (
    ALIGNMENT,
    BLOCK_DTYPES,
    DTYPES,
    FLOAT_DTYPES,
    GROUP_SIZES,
    HEADER_TYPES,
    MAGIC,
    MAX_HEADER_LEN,
    MAX_NDIM,
    OPTIONAL_HEADER_TYPES,
    PREAMBLE,
    QUANT_BITS,
    SCHEMA,
    VERSIONS,
    dtype_version,
    header_checksum,
    region_alignment,
    region_sizes,
)
from baselm.store.errors import BaseFileError

_COMMON_KEYS = {"name", "dtype", "shape", "offset", "length", "checksum_xxh64"}
_QUANT_KEYS = {"group_size", "scale_dtype", "scale_offset", "bias_offset"}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One validated tensor of the header table; offsets are blob-relative."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    checksum: str
    group_size: int | None = None
    scale_dtype: str | None = None
    scale_offset: int | None = None
    bias_offset: int | None = None

    @property
    def bits(self) -> int | None:
        """The affine codes' width of a `base_q*` tensor, else None (also for block tensors)."""
        return QUANT_BITS.get(self.dtype)

    @property
    def block_type(self) -> gguf_blocks.BlockType | None:
        """The block type of a tensor of kept GGUF blocks, else None."""
        return gguf_blocks.BY_DTYPE.get(self.dtype)

    @property
    def num_params(self) -> int:
        return math.prod(self.shape)


def read_preamble(path: Path, f: Any, file_size: int) -> tuple[int, int]:
    """(version, header length) the preamble gives, after checking magic, version and that length."""
    preamble = f.read(PREAMBLE.size)
    if len(preamble) < PREAMBLE.size:
        raise BaseFileError(path, f"it is {file_size} bytes long, shorter than the {PREAMBLE.size}-byte preamble")
    magic, version, header_len = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise BaseFileError(path, f"its magic is {magic!r}, not {MAGIC!r}")
    if version not in VERSIONS:
        newer = "; a newer base wrote it, so upgrade base to read it" if version > max(VERSIONS) else ""
        raise BaseFileError(path, f"its version is {version}, and this build reads {_versions_read()}{newer}")
    if header_len > file_size - PREAMBLE.size:
        raise BaseFileError(path, f"its header length {header_len} runs past the end of the {file_size}-byte file")
    if header_len > MAX_HEADER_LEN:
        raise BaseFileError(path, f"its header length {header_len} exceeds the {MAX_HEADER_LEN}-byte limit")
    return version, header_len


def _versions_read() -> str:
    """The versions this build reads, in words: "version 1", "versions 1 and 2"."""
    *others, last = VERSIONS
    return f"versions {', '.join(map(str, others))} and {last}" if others else f"version {last}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_header(path: Path, raw: bytes, header_len: int) -> dict[str, Any]:
    """The header JSON object: UTF-8, valid JSON (no NaN/Infinity), an object."""
    if len(raw) != header_len:
        raise BaseFileError(path, "the file ended inside the header")
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise BaseFileError(path, f"its header is not UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise BaseFileError(path, f"its header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise BaseFileError(path, f"its header is a JSON {type(header).__name__}, not an object")
    return header


def check_padding(path: Path, f: Any, start: int, blob_start: int, file_size: int) -> None:
    """The file reaches its blob, and the bytes between header and blob are all zero."""
    if file_size < blob_start:
        raise BaseFileError(path, f"it is {file_size} bytes long and ends before its tensor blob at byte {blob_start}")
    if f.read(blob_start - start).count(0) != blob_start - start:
        raise BaseFileError(
            path, f"the padding between its header and blob (bytes {start}..{blob_start}) is not all zero"
        )


def check_header(path: Path, header: dict[str, Any], version: int) -> dict[str, TensorEntry]:
    """Checks the header's keys and types and returns its tensor table; `version` is the preamble's
    (a block dtype needs its own version or a later one)."""
    missing = sorted(set(HEADER_TYPES) - set(header))
    if missing:
        raise BaseFileError(path, f"its header lacks {', '.join(missing)}")
    unknown = sorted(set(header) - set(HEADER_TYPES) - set(OPTIONAL_HEADER_TYPES))
    if unknown:
        raise BaseFileError(path, f"its header has unknown keys {', '.join(unknown)}")
    for key, types in (*HEADER_TYPES.items(), *OPTIONAL_HEADER_TYPES.items()):
        if key in header and not isinstance(header[key], types):
            raise BaseFileError(
                path,
                f"header field {key!r} is a {type(header[key]).__name__}, expected "
                f"{' or '.join(t.__name__ for t in types)}",
            )
    if header["schema"] != SCHEMA:
        raise BaseFileError(path, f"its schema is {header['schema']!r}, and this build reads {SCHEMA!r}")
    if header["alignment"] != ALIGNMENT:
        raise BaseFileError(path, f"its alignment {header['alignment']} differs from the v1 rule {ALIGNMENT}")
    if not all(isinstance(flag, str) for flag in header["flags"]):
        raise BaseFileError(path, "header field 'flags' must be a list of strings")
    tensors: dict[str, TensorEntry] = {}
    for index, item in enumerate(header["tensors"]):
        entry = _parse_entry(path, index, item, version)
        if entry.name in tensors:
            raise BaseFileError(path, f"tensor {entry.name!r} appears twice in its header")
        tensors[entry.name] = entry
    return tensors


def _is_int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _parse_entry(path: Path, index: int, item: Any, version: int) -> TensorEntry:
    """One tensor entry: keys, types, dtype, shape and the sizes its dtype and shape imply."""
    if not isinstance(item, dict):
        raise BaseFileError(path, f"tensor entry {index} is not a JSON object")
    name = item.get("name")
    label = f"tensor {name!r}" if isinstance(name, str) and name else f"tensor entry {index}"
    dtype = item.get("dtype")
    if dtype not in DTYPES:
        raise BaseFileError(path, f"{label} has dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if dtype in BLOCK_DTYPES and version < dtype_version(dtype):
        raise BaseFileError(
            path,
            f"{label} has block dtype {dtype}, which needs a version-{dtype_version(dtype)} file, but the file is "
            f"version {version}",
        )
    keys = _COMMON_KEYS | (_QUANT_KEYS if dtype in QUANT_BITS else set())
    if set(item) != keys:
        wrong = sorted(set(item) ^ keys)
        raise BaseFileError(path, f"{label} ({dtype}) has missing or unexpected keys: {', '.join(wrong)}")
    if not isinstance(name, str) or not name:
        raise BaseFileError(path, f"tensor entry {index} has no name")
    shape = item["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) for d in shape):
        raise BaseFileError(
            path, f"{label} has shape {shape!r}; expected a list of at most {MAX_NDIM} non-negative integers"
        )
    for key in ("offset", "length") + (("group_size", "scale_offset", "bias_offset") if dtype in QUANT_BITS else ()):
        if not _is_int(item[key]):
            raise BaseFileError(path, f"{label} has {key} {item[key]!r}; expected a non-negative integer")
    checksum = item["checksum_xxh64"]
    if not isinstance(checksum, str) or len(checksum) != 16 or any(c not in "0123456789abcdef" for c in checksum):
        raise BaseFileError(path, f"{label} has checksum_xxh64 {checksum!r}; expected 16 lowercase hex digits")
    entry = TensorEntry(
        name,
        dtype,
        tuple(shape),
        item["offset"],
        item["length"],
        checksum,
        *(item.get(k) for k in ("group_size", "scale_dtype", "scale_offset", "bias_offset")),
    )
    _check_sizes(path, label, entry)
    return entry


def _check_sizes(path: Path, label: str, entry: TensorEntry) -> None:
    if entry.dtype in BLOCK_DTYPES:
        _check_block_shape(path, label, entry)
    if entry.bits is not None:
        if len(entry.shape) != 2:
            raise BaseFileError(path, f"{label} is quantized but has {len(entry.shape)} dimensions, not 2")
        if entry.group_size not in GROUP_SIZES:
            raise BaseFileError(path, f"{label} has group_size {entry.group_size}; expected 32, 64 or 128")
        if entry.shape[1] % entry.group_size:
            raise BaseFileError(
                path,
                f"{label} has {entry.shape[1]} input features, not a multiple of its group size {entry.group_size}",
            )
        if entry.scale_dtype not in FLOAT_DTYPES:
            raise BaseFileError(path, f"{label} has scale_dtype {entry.scale_dtype!r}; expected f32, f16 or bf16")
    data_len, scales_len = region_sizes(entry.dtype, entry.shape, entry.group_size, entry.scale_dtype)
    if entry.length != data_len + 2 * scales_len:
        raise BaseFileError(
            path,
            f"{label} has length {entry.length}, but {entry.dtype} {list(entry.shape)} takes "
            f"{data_len + 2 * scales_len} bytes",
        )
    if entry.bits is not None and (entry.scale_offset, entry.bias_offset) != (
        entry.offset + data_len,
        entry.offset + data_len + scales_len,
    ):
        raise BaseFileError(
            path,
            f"{label} has scale_offset {entry.scale_offset} and bias_offset {entry.bias_offset}, "
            f"expected {entry.offset + data_len} and {entry.offset + data_len + scales_len} (codes, scales, biases "
            "back to back)",
        )


def _check_block_shape(path: Path, label: str, entry: TensorEntry) -> None:
    """A block tensor is a matrix of whole blocks along its input."""
    if len(entry.shape) != 2:
        raise BaseFileError(path, f"{label} holds {entry.dtype} blocks but has {len(entry.shape)} dimensions, not 2")
    values = entry.block_type.block_values
    if entry.shape[1] % values:
        raise BaseFileError(
            path,
            f"{label} has {entry.shape[1]} input features, not a multiple of the {values} values of a {entry.dtype} "
            "block",
        )


def check_layout(path: Path, tensors: dict[str, TensorEntry], blob_len: int) -> None:
    """Every region aligned, inside the blob, and no two overlapping."""
    previous: TensorEntry | None = None
    for entry in sorted(tensors.values(), key=lambda e: (e.offset, e.length)):
        alignment = region_alignment(entry.dtype, entry.shape)
        if entry.offset % alignment:
            raise BaseFileError(
                path, f"tensor {entry.name!r} starts at blob offset {entry.offset}, not a multiple of {alignment}"
            )
        if entry.offset + entry.length > blob_len:
            raise BaseFileError(
                path,
                f"tensor {entry.name!r} ends at blob offset {entry.offset + entry.length}, past the blob end "
                f"{blob_len}",
            )
        if previous is not None and entry.offset < previous.offset + previous.length:
            raise BaseFileError(path, f"tensors {previous.name!r} and {entry.name!r} overlap in the blob")
        previous = entry


def check_header_checksum(path: Path, header: dict[str, Any]) -> None:
    """The header matches its own `header_xxh64`."""
    digest = header_checksum(header)
    if digest != header["header_xxh64"]:
        raise BaseFileError(
            path, f"the header fails its checksum (xxh64 {digest}, header says {header['header_xxh64']})"
        )


def check_digest(path: Path, entry: TensorEntry, digest: str) -> None:
    """A region's xxh64 `digest` matches the checksum its entry records."""
    if digest != entry.checksum:
        raise BaseFileError(
            path, f"tensor {entry.name!r} fails its checksum (xxh64 {digest}, header says {entry.checksum})"
        )
