"""The `.base` v1 container: writer, validating reader and inspection.

Layout (all integers little-endian):

    0x00  b"BASE" | u32 version = 1 | u64 header_len | header JSON (UTF-8, header_len bytes)
          zero padding to the next 64 KiB boundary            <- blob start
          tensor blob: one region per tensor, each aligned     <- offsets are blob-relative
          (optional slots after the last region)

The header is canonical JSON (sorted keys, compact separators, ASCII with escapes, no NaN),
so the same inputs give the same bytes. Offsets are relative to the blob start, which makes the tensor layout
independent of the header's length: the writer streams the blob first and writes the header
last (see `write_base_file`).

Alignment rule: a "matrix" region (every quantized tensor, and every float tensor of two or
more dimensions) starts on a 16 KiB boundary, the page size of Apple GPUs, so each weight can
later be wrapped as its own no-copy Metal buffer; every other region (norms, biases, scalars)
starts on a 64-byte boundary.

A quantized tensor (`base_q2` .. `base_q8`) is one region `[codes | scales | biases]` with no
gaps: codes are MLX's affine packing, uint32 `(out, in * bits / 32)`; scales and biases are
`(out, in / group_size)` in `scale_dtype`; `w = scale * q + bias`. They load straight into
`mx.quantized_matmul` / `mx.dequantize`.

`checksum_xxh64` (16 hex digits) covers each tensor's whole region; `header_xxh64` covers the
header itself (its canonical JSON without that key). Both are checked on request (`verify`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
import xxhash

from baselm.store.errors import BaseFileError

MAGIC = b"BASE"
VERSION = 1
SCHEMA = "base.v1"
PREAMBLE = struct.Struct("<4sIQ")  # magic, version, header_len
BLOB_ALIGN = 64 * 1024
MATRIX_ALIGN = 16 * 1024
VECTOR_ALIGN = 64
ALIGNMENT = {"blob": BLOB_ALIGN, "matrix": MATRIX_ALIGN, "vector": VECTOR_ALIGN}
# A header is config + tokenizer + tensor table; far below this even for 200k-token vocabularies.
MAX_HEADER_LEN = 256 * 1024 * 1024
MAX_NDIM = 8
GROUP_SIZES = (32, 64, 128)

# Float dtypes as stored: numpy dtype of the raw little-endian values (bf16 as its uint16 bits).
FLOAT_DTYPES: dict[str, np.dtype] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}
QUANT_BITS = {f"base_q{b}": b for b in (2, 3, 4, 5, 6, 8)}
DTYPES = (*FLOAT_DTYPES, *QUANT_BITS)

_COMMON_KEYS = {"name", "dtype", "shape", "offset", "length", "checksum_xxh64"}
_QUANT_KEYS = {"group_size", "scale_dtype", "scale_offset", "bias_offset"}
_HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "arch": (str,),
    "config": (dict,),
    "tokenizer": (dict,),
    "quant_scheme": (str,),
    "quant_profile": (str, dict, type(None)),
    "source": (dict,),
    "alignment": (dict,),
    "flags": (list,),
    "created": (str,),
    "tensors": (list,),
    "header_xxh64": (str,),
}


# ---------------------------------------------------------------------------------------------
# Shared size rules (writer and reader use the same ones)


def region_sizes(
    dtype: str, shape: tuple[int, ...], group_size: int | None, scale_dtype: str | None
) -> tuple[int, int]:
    """(data or codes bytes, scales bytes) of a region; biases take as many bytes as scales."""
    numel = math.prod(shape)
    if dtype in FLOAT_DTYPES:
        return numel * FLOAT_DTYPES[dtype].itemsize, 0
    out_features, in_features = shape
    codes = out_features * in_features * QUANT_BITS[dtype] // 8
    scales = out_features * (in_features // group_size) * FLOAT_DTYPES[scale_dtype].itemsize
    return codes, scales


def region_alignment(dtype: str, shape: tuple[int, ...]) -> int:
    """16 KiB for matrix regions (quantized or >= 2-D), 64 B for the rest."""
    return MATRIX_ALIGN if dtype in QUANT_BITS or len(shape) >= 2 else VECTOR_ALIGN


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def canonical_json(obj: Any) -> bytes:
    """The one serialization of a header: sorted keys, compact, ASCII (escapes keep even lone
    surrogates of odd vocabularies intact), no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _header_checksum(header: dict[str, Any]) -> str:
    body = {k: v for k, v in header.items() if k != "header_xxh64"}
    return xxhash.xxh64(canonical_json(body)).hexdigest()


# ---------------------------------------------------------------------------------------------
# Records (what the writer takes) and loaded tensors (what the reader returns)


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
            values, _ = float_numpy(mx.array(to_float32(values, own)).astype(_MX_DTYPES[dtype]))
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
                f"codes {codes.shape}, scales {scale_values.shape} and biases {bias_values.shape} are not an MLX triplet of group {group_size}"
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

    @property
    def bits(self) -> int | None:
        return QUANT_BITS.get(self.dtype)

    def buffers(self) -> list[np.ndarray]:
        """The region's parts in file order."""
        return [self.data] if self.bits is None else [self.codes, self.scales, self.biases]

    def check(self, name: str) -> None:
        """Raises ValueError when the arrays disagree with dtype and shape (a writer-side bug)."""
        group, scale_dtype = self.group_size, self.scale_dtype
        if self.bits is not None:
            if len(self.shape) != 2 or group not in GROUP_SIZES or self.shape[1] % group:
                raise ValueError(f"{name}: quantized tensors must be 2-D with in_features divisible by 32/64/128")
            if scale_dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name}: scale_dtype must be f32, f16 or bf16, not {scale_dtype!r}")
        elif self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        expected = region_sizes(self.dtype, self.shape, group, scale_dtype)
        sizes = [b.nbytes for b in self.buffers()]
        if sizes != ([expected[0]] if self.bits is None else [expected[0], expected[1], expected[1]]):
            raise ValueError(f"{name}: array sizes {sizes} do not match {self.dtype} {list(self.shape)}")


_MX_DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def float_numpy(array: np.ndarray | mx.array) -> tuple[np.ndarray, str]:
    """(little-endian numpy values, dtype name) of a float array; bf16 comes back as uint16 bits."""
    if isinstance(array, mx.array):
        if array.dtype == mx.bfloat16:
            return np.array(array.view(mx.uint16)), "bf16"
        names = {mx.float32: "f32", mx.float16: "f16"}
        if array.dtype not in names:
            raise ValueError(f"cannot store an MLX array of dtype {array.dtype}; use a float dtype")
        return np.array(array), names[array.dtype]
    names = {np.dtype("float32"): "f32", np.dtype("float16"): "f16"}
    dtype = np.dtype(array.dtype)
    if dtype.newbyteorder("=") not in names:
        raise ValueError(f"cannot store a numpy array of dtype {dtype}; use float32 or float16 (or an MLX bf16 array)")
    name = names[dtype.newbyteorder("=")]
    return np.asarray(array, dtype=FLOAT_DTYPES[name]), name


# ---------------------------------------------------------------------------------------------
# Writer


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
    """Writes a `.base` v1 file atomically (temp file in the same folder, fsync, rename).

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
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "r+b") as f:
            entries, blob_len = _write_blob(f, reserve, tensors)
            header = {**fields, "tensors": entries}
            header["header_xxh64"] = _header_checksum(header)
            header_bytes = canonical_json(header)
            blob_start = _align(PREAMBLE.size + len(header_bytes), BLOB_ALIGN)
            _move(f, reserve, blob_start, blob_len)
            f.truncate(blob_start + blob_len)
            f.seek(0)
            f.write(PREAMBLE.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes)
            f.write(bytes(blob_start - PREAMBLE.size - len(header_bytes)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _check_fields(fields: dict[str, Any]) -> None:
    """Fails before any tensor is written if the header fields could not make a readable file."""
    for key, value in fields.items():
        types = _HEADER_TYPES[key]
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
    return _align(PREAMBLE.size + len(canonical_json(fields)) + 400 * num_tensors + 1024, BLOB_ALIGN)


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
        offset = _align(position, region_alignment(record.dtype, record.shape))
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


def fsync_dir(folder: Path) -> None:
    """Makes a rename inside `folder` durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reader: validation


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
        return QUANT_BITS.get(self.dtype)

    @property
    def num_params(self) -> int:
        return math.prod(self.shape)


class BaseFile:
    """An opened, validated `.base` file. Tensors are read on demand with `read`/`load`.

    NOTE: `open` checks the whole layout (magic, version, header, every region) before anything
    is trusted; checksums are read and compared only on request (`verify`).
    """

    def __init__(self, path: Path, header: dict[str, Any], tensors: dict[str, TensorEntry], blob_start: int) -> None:
        self.path = path
        self.header = header
        self.tensors = tensors
        self.blob_start = blob_start

    @classmethod
    def open(cls, path: str | os.PathLike) -> BaseFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                header_len = _read_preamble(path, f, file_size)
                header = _parse_header(path, f.read(header_len), header_len)
                blob_start = _align(PREAMBLE.size + header_len, BLOB_ALIGN)
                _check_padding(path, f, PREAMBLE.size + header_len, blob_start, file_size)
        except OSError as exc:
            raise BaseFileError(path, f"it cannot be read ({exc.strerror or exc})") from None
        tensors = _check_header(path, header)
        _check_layout(path, tensors, file_size - blob_start)
        return cls(path, header, tensors, blob_start)

    def verify(self) -> None:
        """Checks the header checksum and every region's checksum, streaming; raises on the first mismatch."""
        _check_header_checksum(self.path, self.header)
        with self._file() as f:
            for entry in self.tensors.values():
                digest = xxhash.xxh64()
                for chunk in _read_chunks(self.path, f, self.blob_start + entry.offset, entry.length):
                    digest.update(chunk)
                _check_digest(self.path, entry, digest.hexdigest())

    def read(self, name: str, verify: bool = False) -> mx.array | QuantizedArray:
        """One tensor as MLX arrays (a float array, or a quantized triplet)."""
        if name not in self.tensors:
            raise KeyError(f"{self.path} has no tensor named {name!r}")
        with self._file() as f:
            return self._read_entry(f, self.tensors[name], verify)

    def load(self, verify: bool = False) -> dict[str, mx.array | QuantizedArray]:
        """All tensors, in file order. Each region is read once, hashed if asked, then copied into MLX."""
        if verify:
            _check_header_checksum(self.path, self.header)
        with self._file() as f:
            return {name: self._read_entry(f, entry, verify) for name, entry in self.tensors.items()}

    def _file(self) -> Any:
        try:
            return open(self.path, "rb")
        except OSError as exc:
            raise BaseFileError(self.path, f"it cannot be read ({exc.strerror or exc})") from None

    def _read_entry(self, f: Any, entry: TensorEntry, verify: bool) -> mx.array | QuantizedArray:
        raw = _read_exact(self.path, f, self.blob_start + entry.offset, entry.length)  # (length,) uint8
        if verify:
            _check_digest(self.path, entry, xxhash.xxh64(raw).hexdigest())
        if entry.bits is None:
            return _mx_float(raw, entry.dtype, entry.shape)
        out_features, in_features = entry.shape
        codes_len = entry.scale_offset - entry.offset
        scales_len = entry.bias_offset - entry.scale_offset
        groups = (out_features, in_features // entry.group_size)
        codes = mx.array(raw[:codes_len].view("<u4").reshape(out_features, -1))  # (out, in * bits / 32)
        scales = _mx_float(raw[codes_len : codes_len + scales_len], entry.scale_dtype, groups)
        biases = _mx_float(raw[codes_len + scales_len :], entry.scale_dtype, groups)
        return QuantizedArray(codes, scales, biases, entry.bits, entry.group_size, (out_features, in_features))


def read_base_file(
    path: str | os.PathLike, verify: bool = False
) -> tuple[dict[str, Any], dict[str, mx.array | QuantizedArray]]:
    """(header, tensors) of a `.base` file, validated first; `verify` also checks every checksum."""
    base = BaseFile.open(path)
    return base.header, base.load(verify=verify)


def model_weights(tensors: dict[str, mx.array | QuantizedArray]) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Flat weights as the model builder takes them, plus the group size of each quantized prefix.

    A quantized `x.weight` becomes `x.weight` (codes), `x.scales` and `x.biases`.
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


def _read_chunks(path: Path, f: Any, position: int, length: int, chunk: int = 8 * 1024 * 1024) -> Iterable[bytes]:
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


def _check_digest(path: Path, entry: TensorEntry, digest: str) -> None:
    if digest != entry.checksum:
        raise BaseFileError(
            path, f"tensor {entry.name!r} fails its checksum (xxh64 {digest}, header says {entry.checksum})"
        )


def _check_header_checksum(path: Path, header: dict[str, Any]) -> None:
    digest = _header_checksum(header)
    if digest != header["header_xxh64"]:
        raise BaseFileError(
            path, f"the header fails its checksum (xxh64 {digest}, header says {header['header_xxh64']})"
        )


def _read_preamble(path: Path, f: Any, file_size: int) -> int:
    preamble = f.read(PREAMBLE.size)
    if len(preamble) < PREAMBLE.size:
        raise BaseFileError(path, f"it is {file_size} bytes long, shorter than the {PREAMBLE.size}-byte preamble")
    magic, version, header_len = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise BaseFileError(path, f"its magic is {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise BaseFileError(path, f"its version is {version}, and this build reads version {VERSION}")
    if header_len > file_size - PREAMBLE.size:
        raise BaseFileError(path, f"its header length {header_len} runs past the end of the {file_size}-byte file")
    if header_len > MAX_HEADER_LEN:
        raise BaseFileError(path, f"its header length {header_len} exceeds the {MAX_HEADER_LEN}-byte limit")
    return header_len


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _parse_header(path: Path, raw: bytes, header_len: int) -> dict[str, Any]:
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


def _check_padding(path: Path, f: Any, start: int, blob_start: int, file_size: int) -> None:
    if file_size < blob_start:
        raise BaseFileError(path, f"it is {file_size} bytes long and ends before its tensor blob at byte {blob_start}")
    if f.read(blob_start - start).count(0) != blob_start - start:
        raise BaseFileError(
            path, f"the padding between its header and blob (bytes {start}..{blob_start}) is not all zero"
        )


def _check_header(path: Path, header: dict[str, Any]) -> dict[str, TensorEntry]:
    """Checks the header's keys and types and returns its tensor table."""
    missing = sorted(set(_HEADER_TYPES) - set(header))
    if missing:
        raise BaseFileError(path, f"its header lacks {', '.join(missing)}")
    unknown = sorted(set(header) - set(_HEADER_TYPES))
    if unknown:
        raise BaseFileError(path, f"its header has unknown keys {', '.join(unknown)}")
    for key, types in _HEADER_TYPES.items():
        if not isinstance(header[key], types):
            raise BaseFileError(
                path,
                f"header field {key!r} is a {type(header[key]).__name__}, expected {' or '.join(t.__name__ for t in types)}",
            )
    if header["schema"] != SCHEMA:
        raise BaseFileError(path, f"its schema is {header['schema']!r}, and this build reads {SCHEMA!r}")
    if header["alignment"] != ALIGNMENT:
        raise BaseFileError(path, f"its alignment {header['alignment']} differs from the v1 rule {ALIGNMENT}")
    if not all(isinstance(flag, str) for flag in header["flags"]):
        raise BaseFileError(path, "header field 'flags' must be a list of strings")
    tensors: dict[str, TensorEntry] = {}
    for index, item in enumerate(header["tensors"]):
        entry = _parse_entry(path, index, item)
        if entry.name in tensors:
            raise BaseFileError(path, f"tensor {entry.name!r} appears twice in its header")
        tensors[entry.name] = entry
    return tensors


def _is_int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _parse_entry(path: Path, index: int, item: Any) -> TensorEntry:
    """One tensor entry: keys, types, dtype, shape and the sizes its dtype and shape imply."""
    if not isinstance(item, dict):
        raise BaseFileError(path, f"tensor entry {index} is not a JSON object")
    name = item.get("name")
    label = f"tensor {name!r}" if isinstance(name, str) and name else f"tensor entry {index}"
    dtype = item.get("dtype")
    if dtype not in DTYPES:
        raise BaseFileError(path, f"{label} has dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
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
            f"{label} has length {entry.length}, but {entry.dtype} {list(entry.shape)} takes {data_len + 2 * scales_len} bytes",
        )
    if entry.bits is not None and (entry.scale_offset, entry.bias_offset) != (
        entry.offset + data_len,
        entry.offset + data_len + scales_len,
    ):
        raise BaseFileError(
            path,
            f"{label} has scale_offset {entry.scale_offset} and bias_offset {entry.bias_offset}, "
            f"expected {entry.offset + data_len} and {entry.offset + data_len + scales_len} (codes, scales, biases back to back)",
        )


def _check_layout(path: Path, tensors: dict[str, TensorEntry], blob_len: int) -> None:
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
                f"tensor {entry.name!r} ends at blob offset {entry.offset + entry.length}, past the blob end {blob_len}",
            )
        if previous is not None and entry.offset < previous.offset + previous.length:
            raise BaseFileError(path, f"tensors {previous.name!r} and {entry.name!r} overlap in the blob")
        previous = entry


# ---------------------------------------------------------------------------------------------
# Inspection


def inspect_report(path: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """A summary of a `.base` file for `base inspect`: header fields, tensor table and totals.

    With `verify`, every checksum is checked first (a mismatch raises BaseFileError).
    """
    base = BaseFile.open(path)
    if verify:
        base.verify()
    header = base.header
    rows = [
        {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "group_size": e.group_size, "bytes": e.length}
        for e in base.tensors.values()
    ]
    by_dtype: dict[str, dict[str, int]] = {}
    for entry in base.tensors.values():
        totals = by_dtype.setdefault(entry.dtype, {"tensors": 0, "params": 0, "bytes": 0})
        totals["tensors"] += 1
        totals["params"] += entry.num_params
        totals["bytes"] += entry.length
    num_params = sum(t["params"] for t in by_dtype.values())
    tensor_bytes = sum(t["bytes"] for t in by_dtype.values())
    profile = header["quant_profile"]
    return {
        "path": str(base.path),
        "file_bytes": base.path.stat().st_size,
        "schema": header["schema"],
        "arch": header["arch"],
        "quant_scheme": header["quant_scheme"],
        "quant_profile": profile.get("name") if isinstance(profile, dict) else profile,
        "source": header["source"],
        "created": header["created"],
        "flags": header["flags"],
        "verified": verify,
        "tensors": rows,
        "totals": {
            "tensors": len(rows),
            "params": num_params,
            "bytes": tensor_bytes,
            "bits_per_weight": round(8 * tensor_bytes / num_params, 3) if num_params else 0.0,
            "by_dtype": by_dtype,
        },
    }


def render_inspect(report: dict[str, Any], console: Any, max_rows: int | None = None) -> None:
    """Prints an `inspect_report` on a rich console: a summary, then the tensor table."""
    from rich.table import Table  # the CLI's renderer; the store itself never needs rich

    totals = report["totals"]
    source = report["source"]
    console.print(f"[bold]{report['path']}[/bold]  {report['schema']}  arch={report['arch']}")
    console.print(
        f"quant {report['quant_scheme']} (profile {report['quant_profile']}), "
        f"{totals['tensors']} tensors, {totals['params']:,} params, {_human(totals['bytes'])} "
        f"({totals['bits_per_weight']} bits/weight), created {report['created']}"
    )
    if source:
        console.print("source: " + ", ".join(f"{k}={v}" for k, v in sorted(source.items()) if v))
    console.print("checksums: " + ("verified" if report["verified"] else "not checked (use --verify)"))
    table = Table("name", "dtype", "shape", "group", "bytes")
    rows = report["tensors"] if max_rows is None else report["tensors"][:max_rows]
    for row in rows:
        shape = "x".join(str(d) for d in row["shape"]) or "scalar"
        table.add_row(row["name"], row["dtype"], shape, str(row["group_size"] or ""), _human(row["bytes"]))
    console.print(table)
    if len(rows) < len(report["tensors"]):
        console.print(f"... {len(report['tensors']) - len(rows)} more tensors")
    summary = Table("dtype", "tensors", "params", "bytes")
    for dtype, t in sorted(report["totals"]["by_dtype"].items()):
        summary.add_row(dtype, str(t["tensors"]), f"{t['params']:,}", _human(t["bytes"]))
    console.print(summary)


def _human(num_bytes: float) -> str:
    if num_bytes < 1024:
        return f"{int(num_bytes)} B"
    for unit in ("KiB", "MiB", "GiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}"
