"""Writing a `.base` file: `TensorRecord`s streamed into the blob, the header written last, atomically."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from baselm import gguf_blocks
from baselm.store.base_format import (
    ALIGNMENT,
    BLOB_ALIGN,
    DTYPES,
    FLOAT_DTYPES,
    GROUP_SIZES,
    HEADER_TYPES,
    MAGIC,
    MX_DTYPES,
    OPTIONAL_HEADER_TYPES,
    PREAMBLE,
    QUANT_BITS,
    SCHEMA,
    align,
    canonical_json,
    file_version,
    float_numpy,
    header_checksum,
    region_alignment,
    region_sizes,
    to_float32,
)
from baselm.store.fs import atomic_write


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor ready to be written: raw float values, or a quantized triplet in MLX packing.

    NOTE: arrays are numpy, little-endian and C-contiguous; bf16 values are held as uint16 bits.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    codes: np.ndarray | None = None  # (out, in * bits / 32) uint32
    scales: np.ndarray | None = None  # (out, in / group_size)
    biases: np.ndarray | None = None  # (out, in / group_size)
    group_size: int | None = None
    scale_dtype: str | None = None

    @classmethod
    def from_array(cls, array: np.ndarray | mx.array, dtype: str | None = None) -> TensorRecord:
        """A float record; `dtype` (f32|f16|bf16) converts, None keeps the array's own float dtype."""
        values, own = float_numpy(array)
        dtype = dtype or own
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"float tensors are stored as f32, f16 or bf16, not {dtype!r}")
        if dtype != own:
            values, _ = float_numpy(mx.array(to_float32(values, own)).astype(MX_DTYPES[dtype]))
        return cls(dtype=dtype, shape=tuple(values.shape), data=np.ascontiguousarray(values))

    @classmethod
    def from_triplet(
        cls, codes: mx.array | np.ndarray, scales: mx.array | np.ndarray, biases: mx.array | np.ndarray, group_size: int
    ) -> TensorRecord:
        """A quantized record from an MLX affine triplet as it is (e.g. GGUF Q4_1 read by `mx.load`).

        Bits follow from the shapes: `in = scales.shape[1] * group_size`, `bits = 32 * codes.shape[1] / in`.
        """
        codes = np.ascontiguousarray(np.array(codes), dtype="<u4")  # (out, in * bits / 32)
        scale_values, scale_dtype = float_numpy(scales)  # (out, in / group_size)
        bias_values, bias_dtype = float_numpy(biases)
        if codes.ndim != 2 or scale_values.ndim != 2 or scale_values.shape[1] == 0:
            raise ValueError(f"codes {codes.shape} and scales {scale_values.shape} are not 2-D MLX triplet parts")
        in_features = scale_values.shape[1] * group_size
        bits, rem = divmod(codes.shape[1] * 32, in_features)
        if (
            rem
            or bits not in QUANT_BITS.values()
            or bias_dtype != scale_dtype
            or bias_values.shape != scale_values.shape
        ):
            raise ValueError(
                f"codes {codes.shape}, scales {scale_values.shape} and biases {bias_values.shape} are not an MLX "
                f"triplet of group {group_size}"
            )
        return cls(
            dtype=f"base_q{bits}",
            shape=(codes.shape[0], in_features),
            codes=codes,
            scales=np.ascontiguousarray(scale_values),
            biases=np.ascontiguousarray(bias_values),
            group_size=group_size,
            scale_dtype=scale_dtype,
        )

    @classmethod
    def from_blocks(cls, dtype: str, data: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
        """A matrix of GGUF blocks kept as they are (baselm/gguf_blocks.py), a block dtype (`gguf_q8_0`,
        `gguf_q4_k` ...) of logical `shape` (out, in): `data` the rows' bytes, uint8
        (out, in / block values * block bytes) or flat. A contiguous `data` is kept as it is, not copied."""
        if dtype not in gguf_blocks.BY_DTYPE:
            raise ValueError(f"{dtype!r} is not a block dtype; expected one of {', '.join(gguf_blocks.BY_DTYPE)}")
        if len(shape) != 2:
            raise ValueError(f"a {dtype} tensor is a matrix (out, in), not shape {list(shape)}")
        rows, row_bytes = shape[0], gguf_blocks.row_bytes(dtype, shape[1])
        data = np.asarray(data)
        if data.dtype != np.uint8:
            raise ValueError(f"{dtype} blocks are uint8 bytes, not {data.dtype}")
        if data.size != rows * row_bytes or data.shape not in ((rows * row_bytes,), (rows, row_bytes)):
            raise ValueError(
                f"{dtype} blocks of shape {list(data.shape)} are not a matrix of shape {list(shape)} "
                f"({rows} rows of {row_bytes} bytes)"
            )
        return cls(dtype=dtype, shape=(rows, shape[1]), data=np.ascontiguousarray(data).reshape(rows, row_bytes))

    @property
    def bits(self) -> int | None:
        """The affine codes' width of a `base_q*` record, else None (float and block records)."""
        return QUANT_BITS.get(self.dtype)

    @property
    def block_type(self) -> gguf_blocks.BlockType | None:
        """The block type of a record of kept GGUF blocks, else None."""
        return gguf_blocks.BY_DTYPE.get(self.dtype)

    def buffers(self) -> list[np.ndarray]:
        """The region's parts in file order: [data] of a float or block record, [codes, scales, biases] of an
        affine one."""
        return [self.data] if self.bits is None else [self.codes, self.scales, self.biases]

    def check(self, name: str) -> None:
        """Raises ValueError when the arrays disagree with dtype and shape (a writer-side bug)."""
        group, scale_dtype = self.group_size, self.scale_dtype
        if self.bits is not None:
            if len(self.shape) != 2 or group not in GROUP_SIZES or self.shape[1] % group:
                raise ValueError(f"{name}: quantized tensors must be 2-D with in_features divisible by 32/64/128")
            if scale_dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name}: scale_dtype must be f32, f16 or bf16, not {scale_dtype!r}")
        elif self.block_type is not None:
            values = self.block_type.block_values
            if len(self.shape) != 2 or self.shape[1] % values or self.data.dtype != np.uint8:
                raise ValueError(f"{name}: {self.dtype} tensors are 2-D uint8 blocks with in_features % {values} == 0")
        elif self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        expected = region_sizes(self.dtype, self.shape, group, scale_dtype)
        sizes = [b.nbytes for b in self.buffers()]
        if sizes != ([expected[0]] if self.bits is None else [expected[0], expected[1], expected[1]]):
            raise ValueError(f"{name}: array sizes {sizes} do not match {self.dtype} {list(self.shape)}")


def write_base_file(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, TensorRecord | np.ndarray | mx.array]],
    *,
    arch: str,
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    quant_scheme: str,
    quant_profile: str | dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
    flags: Iterable[str] = (),
    created: str | None = None,
    _reserve_bytes: int | None = None,
) -> Path:
    """Writes a `.base` file atomically (temp file in the same folder, fsync, rename): the version its
    block records' dtypes need (2 to 4, `base_format.file_version`), else version 1.

    Tensors are consumed one at a time and never held together: the blob is streamed into the
    file behind a reserved header area; the header, known only at the end, then goes in front,
    and the blob is moved once if the reservation was not the canonical size. `created`
    defaults to now (UTC, ISO 8601); pass it fixed for reproducible bytes.
    """
    path = Path(path)
    fields = {
        "schema": SCHEMA,
        "arch": arch,
        "config": config,
        "tokenizer": tokenizer,
        "quant_scheme": quant_scheme,
        "quant_profile": quant_profile,
        "source": source or {},
        "alignment": ALIGNMENT,
        "flags": sorted(flags),
        "created": created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    _check_fields(fields)
    reserve = _reserve_bytes if _reserve_bytes is not None else _estimate_reserve(fields, tensors)
    with atomic_write(path, "r+b") as f:
        entries, blob_len = _write_blob(f, reserve, tensors)
        _write_header(f, {**fields, "tensors": entries}, reserve, blob_len)
    return path


def rewrite_header(f: Any, header: dict[str, Any], blob_start: int, blob_len: int) -> None:
    """Gives the complete file open in `f` (blob at `blob_start`) a new header, moving the blob as needed."""
    _check_fields({k: v for k, v in header.items() if k != "tensors"})
    _write_header(f, header, blob_start, blob_len)


def _write_header(f: Any, header: dict[str, Any], reserve: int, blob_len: int) -> None:
    """Puts the preamble and `header` (given its checksum) in front of the blob written at `reserve`,
    moving the blob to the start its header's length gives it."""
    header["header_xxh64"] = header_checksum(header)
    header_bytes = canonical_json(header)
    blob_start = align(PREAMBLE.size + len(header_bytes), BLOB_ALIGN)
    _move(f, reserve, blob_start, blob_len)
    f.truncate(blob_start + blob_len)
    f.seek(0)
    version = file_version(t["dtype"] for t in header["tensors"])  # a rewritten header keeps its blocks' version
    f.write(PREAMBLE.pack(MAGIC, version, len(header_bytes)) + header_bytes)
    f.write(bytes(blob_start - PREAMBLE.size - len(header_bytes)))


def _check_fields(fields: dict[str, Any]) -> None:
    """Fails before any tensor is written if the header fields could not make a readable file."""
    for key, value in fields.items():
        types = HEADER_TYPES.get(key) or OPTIONAL_HEADER_TYPES[key]
        if not isinstance(value, types):
            raise ValueError(
                f"header field {key!r} must be {' or '.join(t.__name__ for t in types)}, not {type(value).__name__}"
            )
    if not all(isinstance(flag, str) for flag in fields["flags"]):
        raise ValueError("header field 'flags' must hold strings only")
    try:
        canonical_json(fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"header fields are not plain JSON ({exc})") from None


def _estimate_reserve(fields: dict[str, Any], tensors: Iterable[Any]) -> int:
    num_tensors = len(tensors) if hasattr(tensors, "__len__") else 512
    return align(PREAMBLE.size + len(canonical_json(fields)) + 400 * num_tensors + 1024, BLOB_ALIGN)


def _write_blob(f: Any, blob_start: int, tensors: Iterable[tuple[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Streams every region to `blob_start + offset`; returns the tensor entries and blob length."""
    entries: list[dict[str, Any]] = []
    names: set[str] = set()
    position = blob_len = 0
    for name, item in tensors:
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"tensor names must be unique non-empty strings; got {name!r}")
        names.add(name)
        record = item if isinstance(item, TensorRecord) else TensorRecord.from_array(item)
        record.check(name)
        offset = align(position, region_alignment(record.dtype, record.shape))
        f.seek(blob_start + offset)
        digest = xxhash.xxh64()
        for buffer in record.buffers():
            view = memoryview(np.ascontiguousarray(buffer)).cast("B")
            digest.update(view)
            f.write(view)
        entries.append(_entry_json(name, record, offset, digest.hexdigest()))
        position = offset + entries[-1]["length"]
        blob_len = max(blob_len, position)
    return entries, blob_len


def _entry_json(name: str, record: TensorRecord, offset: int, checksum: str) -> dict[str, Any]:
    data_len, scales_len = region_sizes(record.dtype, record.shape, record.group_size, record.scale_dtype)
    entry = {
        "name": name,
        "dtype": record.dtype,
        "shape": list(record.shape),
        "offset": offset,
        "length": data_len + 2 * scales_len,
        "checksum_xxh64": checksum,
    }
    if record.bits is not None:
        entry |= {
            "group_size": record.group_size,
            "scale_dtype": record.scale_dtype,
            "scale_offset": offset + data_len,
            "bias_offset": offset + data_len + scales_len,
        }
    return entry


def _move(f: Any, source: int, target: int, length: int, chunk: int = 8 * 1024 * 1024) -> None:
    """Moves `length` bytes from `source` to `target` inside the file, overlap-safe."""
    if source == target or length == 0:
        return
    starts = list(range(0, length, chunk))
    for start in reversed(starts) if target > source else starts:
        f.seek(source + start)
        data = f.read(min(chunk, length - start))
        f.seek(target + start)
        f.write(data)
