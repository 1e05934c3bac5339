"""Reads a GGUF file as an HF-shaped model: config dict, HF tensor names, q/k rows in HF order.

The file is parsed here (header, metadata, tensor table) and memory-mapped; each tensor's raw
blocks are kept as they are where the CPU kernels run them (`baselm/gguf_blocks.py`: Q4_0 ... Q8_0,
IQ4_NL, Q2_K ... Q6_K, IQ4_XS), else decoded by `store/gguf_quants.py` (F32/F16/BF16 as they are,
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as exact MLX affine triplets of group 32), `store/gguf_kquants.py`
(Q3_K/Q4_K/Q5_K exact, Q2_K/Q6_K re-quantized), `store/gguf_iquants.py` (IQ4_NL/IQ4_XS exact) and
`store/mxfp4.py` (MXFP4 widened exactly to floats);
`store/gguf_arch.py` says where each tensor goes for each architecture.
The metadata comes back as plain Python values (str, int, float, bool, lists of them), ready for
a `.base` header. NOTE: `gguf.GGUFReader` reads the same data, but it builds a numpy view per
vocabulary string and takes seconds to open a 50k-token file; this parser takes a fraction of
one, and the tests check it against `GGUFReader`.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from baselm import gguf_blocks
from baselm.store import gguf_arch, gguf_config, gguf_gpt_oss, gguf_split
from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.gguf_affine import affine_record, record_arrays
from baselm.store.gguf_arch import ROPE_FACTORS, ROPE_FREQS, Placement
from baselm.store.gguf_kquants import K_SCHEMES, RequantError, is_exact, k_values
from baselm.store.gguf_quants import FLOAT_TYPES, check_readable, float_record
from baselm.store.gguf_rows import put_back, unpermute_rows
from baselm.store.mxfp4 import gguf_mxfp4_record

__all__ = [
    "ROPE_FREQS",
    "GGUFCheckpoint",
    "GGUFFile",
    "TensorInfo",
    "load_checkpoint",
    "read_metadata",
    "unpermute_rows",
]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
log = logging.getLogger(__name__)

# GGUF metadata value types: id -> struct format of a scalar (8 string, 9 array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_NESTING = 8  # metadata arrays inside arrays; llama.cpp writes at most 2, a deeper file is malformed
NUM_READERS = min(4, os.cpu_count() or 1)  # threads converting tensors (GGUFCheckpoint.records)
READ_AHEAD_BYTES = 16 * 2**20  # tensor bytes converted ahead of the consumer, past the one it waits for


# ---------------------------------------------------------------------------------------------
# The file: metadata and tensor table


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the table: numpy-order shape (outermost first), type name, absolute offset in
    the file `part` (0 but in a split GGUF's later parts)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int
    part: int = 0

    @property
    def num_params(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """An opened GGUF file: its metadata, its tensor table, and its bytes memory-mapped; for a
    split GGUF (`gguf_split.py`), opened from its first part, every part's tensors and bytes."""

    def __init__(
        self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], data: list[mmap.mmap]
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._data = data  # one mapping per part

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        data, metadata, tensors = _open_part(path, 0)
        parts = [data]
        others = gguf_split.other_parts(path, metadata)
        for index, part_path in enumerate(others, start=1):
            part_data, part_metadata, part_tensors = _open_part(part_path, index)
            gguf_split.check_part(part_path, part_metadata, index, len(others) + 1)
            if tensors.keys() & part_tensors.keys():
                raise ModelFileError(f"{part_path}: holds tensors an earlier part holds too")
            parts.append(part_data)
            tensors.update(part_tensors)
        if others:
            gguf_split.check_tensor_count(path, metadata, len(tensors))
        return cls(path, metadata, tensors, parts)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, (num_bytes,) uint8, a view of the mapped file (nothing is copied)."""
        return np.frombuffer(self._data[info.part], dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    def release(self, info: TensorInfo) -> None:
        """Drops the tensor's mapped pages from this process's memory (they stay in the page cache;
        reading the tensor again, or a view of it, maps them back)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        self._data[info.part].madvise(mmap.MADV_DONTNEED, start, info.offset + info.num_bytes - start)

    def check_types(self) -> None:
        """A clear error if any tensor has a type base cannot read, before anything is converted."""
        for info in self.tensors.values():
            check_readable(info.type_name, info.name, self.path.name)
            if info.type_name not in FLOAT_TYPES and len(info.shape) < 2:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor {info.name!r} is a {len(info.shape)}-D {info.type_name} tensor; base "
                    "reads quantized tensors only as matrices (or stacks of them)"
                )

    def read(
        self,
        info: TensorInfo,
        errors: dict[str, RequantError] | None = None,
        inexact_as_float: bool = False,
        keep_blocks: frozenset[str] = frozenset(),
    ) -> TensorRecord:
        """One tensor as a `.base` record. Quantized ones are 2-D, (rows, inputs), a stack's matrices
        one under the other; a Q2_K/Q6_K tensor is re-quantized and its error added to `errors`, or
        with `inexact_as_float` given as its float32 values (for a caller that quantizes anyway).
        A matrix of a GGUF type in `keep_blocks` comes as its blocks (baselm/gguf_blocks.py), a view
        of the mapped file; stacks of them (experts) are converted as without."""
        check_readable(info.type_name, info.name, self.path.name)
        raw = self.raw(info)
        if info.type_name in FLOAT_TYPES:
            return float_record(info.type_name, raw, info.shape)
        if info.type_name == "MXFP4":  # exact as floats: `.base` has no MXFP4 dtype
            return gguf_mxfp4_record(raw, info.shape)
        shape = (math.prod(info.shape[:-1]), info.shape[-1])
        block_type = gguf_blocks.BY_GGUF_TYPE.get(info.type_name)
        if info.type_name in keep_blocks and block_type and len(info.shape) == 2 and not inexact_as_float:
            return TensorRecord.from_blocks(block_type.dtype, raw.reshape(shape[0], -1), shape)
        try:
            if inexact_as_float and info.type_name in K_SCHEMES and not is_exact(info.type_name):
                return TensorRecord.from_array(k_values(info.type_name, raw, shape))
            return affine_record(info.type_name, raw, shape, info.name, {} if errors is None else errors)
        except ValueError as exc:
            raise ModelFileError(f"{self.path.name}: tensor {info.name!r}: {exc}") from None


def _open_part(path: Path, part: int) -> tuple[mmap.mmap, dict[str, Any], dict[str, TensorInfo]]:
    """One file mapped and parsed: (its bytes, its metadata, its tensors, which say they are in `part`)."""
    if not path.is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
    try:
        metadata, tensors = _Parser(data, part).parse()
    except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
    _check_extents(path, tensors, len(data))
    return data, metadata, tensors


class _Parser:
    """Reads the header, the metadata and the tensor table from the start of a mapped file."""

    def __init__(self, data: mmap.mmap, part: int = 0) -> None:
        self.data, self.pos, self.part = data, 0, part

    def parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        magic = bytes(self.data[0:4])
        if magic != MAGIC:
            raise ValueError(f"its magic is {magic!r}, not {MAGIC!r}")
        self.pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows versions 2 and 3, little-endian)")
        num_tensors, num_kv = self._scalar("Q"), self._scalar("Q")
        metadata = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._scalar("I"), 0)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0:
            raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
        start = -(-self.pos // alignment) * alignment
        tensors = {
            name: TensorInfo(name, type_name, shape, start + offset, num_bytes, self.part)
            for name, type_name, shape, offset, num_bytes in infos
        }
        if len(tensors) != len(infos):
            raise ValueError("a tensor name appears twice")
        return metadata, tensors

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        if self.pos + length > len(self.data):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = self.data[self.pos : self.pos + length].decode("utf-8")
        self.pos += length
        return text

    def _value(self, kind: int, depth: int) -> Any:
        """One metadata value of type `kind`, inside `depth` arrays."""
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        if depth == MAX_ARRAY_NESTING:
            raise ValueError(f"its metadata holds arrays nested more than {MAX_ARRAY_NESTING} deep")
        item_kind, count = self._scalar("I"), self._scalar("Q")
        if item_kind in _NUMPY:  # numbers in one read
            values = np.frombuffer(self.data, dtype=_NUMPY[item_kind], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.astype(bool).tolist() if item_kind == 7 else values.tolist()
        if item_kind == _STRING:
            return self._strings(count)
        return [self._value(item_kind, depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """An array of strings (vocabularies, merges): the hot loop of opening a file."""
        data, pos, size, unpack = self.data, self.pos, len(self.data), struct.Struct("<Q").unpack_from
        strings = []
        for _ in range(count):
            (length,) = unpack(data, pos)
            pos += 8
            if pos + length > size:
                raise ValueError(f"a string of {length} bytes runs past the end of the file")
            strings.append(data[pos : pos + length].decode("utf-8"))
            pos += length
        self.pos = pos
        return strings

    def _tensor_info(self) -> tuple[str, str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("I")
        dims = [self._scalar("Q") for _ in range(num_dims)]  # innermost first
        type_id, offset = self._scalar("I"), self._scalar("Q")
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block_size:
            raise ValueError(
                f"tensor {name!r} has {dims[0]} values per row, not a multiple of {kind.name}'s block of {block_size}"
            )
        num_bytes = math.prod(dims) // block_size * type_size  # Python ints: a forged shape cannot wrap to a small size
        return name, kind.name, tuple(reversed(dims)), offset, num_bytes


def _check_extents(path: Path, tensors: dict[str, TensorInfo], file_size: int) -> None:
    for info in tensors.values():
        if info.num_bytes > file_size:
            raise ModelFileError(
                f"{path}: tensor {info.name!r} has shape {info.shape}, {info.num_bytes} bytes of "
                f"{info.type_name}: more than the file's {file_size} bytes (a damaged or forged file)"
            )
        if info.offset + info.num_bytes > file_size:
            raise ModelFileError(f"{path}: tensor {info.name!r} runs past the end of the file (truncated download?)")


# ---------------------------------------------------------------------------------------------
# The checkpoint view: HF config, HF names, `.base` records


class GGUFCheckpoint:
    """A GGUF file read as the HF checkpoint it was converted from: the config, and every tensor as
    a `.base` record under its HF name with llama.cpp's changes undone (q/k row order, Gemma's
    `1 + w` norms, stacked experts split). Both `base run file.gguf` and `base pull` read this, so
    they load the same weights."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        gguf_file.check_types()
        self.file = gguf_file
        shapes = {name: info.shape for name, info in gguf_file.tensors.items()}
        self.config, self.spec, meta = gguf_config.hf_config(gguf_file.metadata, shapes)
        self._add_rope_factors()
        # Every tensor placed before any is read: a tensor base cannot place is refused up front.
        placed = [(name, gguf_arch.placement(name, self.spec, self.config, meta)) for name in gguf_file.tensors]
        self._placed = sorted(((where.hf_name, name, where) for name, where in placed if where), key=lambda t: t[0])
        self.requant_errors: dict[str, RequantError] = {}

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        return cls(GGUFFile.open(path))

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata

    def release_metadata(self) -> None:
        """Drops the metadata (a vocabulary's strings: tens of MiB) once the caller has what it
        needs; `config` and the tensors stay readable."""
        self.file.metadata = {}

    def _add_rope_factors(self) -> None:
        """Phi-3's LongRoPE factors live in tensors; HF keeps them in the config's rope dict."""
        scaling = self.config.get("rope_scaling")
        if not scaling or scaling.get("rope_type") != "longrope":
            return
        for key, name in zip(("long_factor", "short_factor"), ROPE_FACTORS, strict=True):
            if name not in self.file.tensors:
                raise ModelFileError(f"{self.file.path.name}: LongRoPE scaling without its {name} tensor")
            record = self.file.read(self.file.tensors[name])
            scaling[key] = to_float32(record.data, record.dtype).reshape(-1).tolist()

    def records(
        self,
        inexact_as_float: bool = False,
        skip: frozenset[str] = frozenset(),
        keep_blocks: frozenset[str] = frozenset(),
    ) -> Iterator[tuple[str, str, TensorRecord]]:
        """(HF name, GGUF type, record) per tensor, sorted by HF name, converted a few tensors ahead
        of the consumer (`_read_ahead`); HF tensors named in `skip` are left out.

        Re-quantized K-quants (Q2_K, Q6_K) add their error to `requant_errors`, logged at the end;
        with `inexact_as_float` they come as float32 values instead (the caller quantizes them once).
        Matrices of the GGUF types in `keep_blocks` come as their blocks (`GGUFFile.read`).
        """
        self.requant_errors = {}
        fused_parts: dict[str, dict[str, tuple[TensorRecord, tuple[int, ...]]]] = {}
        placed = [item for item in self._placed if item[0] not in skip]
        for (hf_name, name, where), record, errors in self._read_ahead(placed, inexact_as_float, keep_blocks):
            info = self.file.tensors[name]
            for type_name, error in errors.items():
                self.requant_errors.setdefault(type_name, RequantError(type_name, error.bits)).merge(error)
            if where.expert_part is not None:  # gpt-oss: parts of one HF tensor sort next to each other
                parts = fused_parts.setdefault(hf_name, {})
                parts[where.expert_part] = (record, info.shape)
                kind = "down" if "down" in parts else "gate_up"
                if set(parts) == set(gguf_gpt_oss.PARTS[kind]):
                    yield hf_name, info.type_name, gguf_gpt_oss.fused_record(kind, fused_parts.pop(hf_name))
                continue
            for out_name, part in put_back(record, where):
                yield out_name, info.type_name, part
            # The consumer has taken the record (a view of the mapping is copied into MLX arrays as
            # it is read, which maps its pages back in): they can go again, so that a load holds the
            # file's bytes once, not twice.
            self.file.release(info)
        if fused_parts:
            raise ModelFileError(f"{self.file.path.name}: {next(iter(fused_parts))} lacks its gate or up experts")
        for error in self.requant_errors.values():
            log.warning("%s: %s", self.file.path.name, error.describe())

    def _read_ahead(
        self, placed: list[tuple[str, str, Placement]], inexact_as_float: bool, keep_blocks: frozenset[str]
    ) -> Iterator[tuple[tuple[str, str, Placement], TensorRecord, dict[str, RequantError]]]:
        """(placed item, its record, its re-quantization errors) for each of `placed`, in order, converted
        on a few threads: numpy releases the GIL inside its loops, so tensors convert side by side.

        NOTE: past the tensor the consumer waits for, at most READ_AHEAD_BYTES of the file's tensors
        are converted or converting, which bounds the memory the records waiting take."""

        def read(info: TensorInfo) -> tuple[TensorRecord, dict[str, RequantError]]:
            errors: dict[str, RequantError] = {}
            record = self.file.read(info, errors, inexact_as_float, keep_blocks)
            # A converted tensor is a copy already, and a float or block one (a view of the mapping)
            # maps its pages back in from the page cache as it is read: the mapped pages can go now.
            self.file.release(info)
            return record, errors

        todo, queue, num_queued = deque(placed), deque(), 0
        pool = ThreadPoolExecutor(NUM_READERS, thread_name_prefix="gguf-read")
        try:
            while todo or queue:
                while todo and (not queue or num_queued < READ_AHEAD_BYTES):
                    item = todo.popleft()
                    info = self.file.tensors[item[1]]
                    queue.append((item, pool.submit(read, info), info.num_bytes))
                    num_queued += info.num_bytes
                item, future, num_bytes = queue.popleft()
                num_queued -= num_bytes
                yield item, *future.result()
        finally:
            pool.shutdown(cancel_futures=True)

    def mx_weights(self, keep_blocks: frozenset[str] = frozenset()) -> dict[str, mx.array]:
        """Every tensor as MLX arrays under HF names (quantized ones as `.weight`/`.scales`/`.biases`,
        matrices of the GGUF types in `keep_blocks` as their blocks, `x.q8_0`, `x.q4_k` ...: the model
        decides whether it runs them so or the loader converts them, `blocks_as_triplets`).

        gpt-oss experts stored as MXFP4 come back as the HF checkpoint's `_blocks`/`_scales`, so the
        model runs them as MXFP4 (a `.base` file, which has no MXFP4 dtype, gets `records`' floats).
        """
        mxfp4: dict[str, dict[str, tuple[np.ndarray, tuple[int, ...]]]] = {}
        for hf_name, name, where in self._placed:
            info = self.file.tensors[name]
            if where.expert_part is not None and info.type_name == "MXFP4":
                mxfp4.setdefault(hf_name, {})[where.expert_part] = (self.file.raw(info), info.shape)
        weights: dict[str, mx.array] = {}
        for name, _, record in self.records(skip=frozenset(mxfp4), keep_blocks=keep_blocks):
            weights.update(record_arrays(name, record))
        for hf_name, parts in mxfp4.items():
            weights.update(gguf_gpt_oss.hf_mxfp4(hf_name, parts))
        return weights


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """(HF config, MLX weights under HF names, GGUF metadata) of a GGUF file: what `base run` loads."""
    checkpoint = GGUFCheckpoint.open(path)
    return checkpoint.config, checkpoint.mx_weights(), checkpoint.metadata


def read_metadata(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """All tensors (GGUF names, as stored: no renaming or reordering) and the metadata of a GGUF file.

    Quantized tensors come back as MLX triplets (`x.weight` uint32 codes, `x.scales`, `x.biases`,
    groups of 32), K-quants as `GGUFFile.read` keeps them.
    """
    gguf_file = GGUFFile.open(path)
    gguf_file.check_types()
    tensors: dict[str, mx.array] = {}
    for name, info in gguf_file.tensors.items():
        tensors.update(record_arrays(name, gguf_file.read(info)))
        gguf_file.release(info)  # copied into MLX arrays: the mapped pages need not stay resident
    return tensors, gguf_file.metadata
