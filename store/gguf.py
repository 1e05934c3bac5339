"""Reads a GGUF file as an HF-shaped model: config dict, HF tensor names, q/k rows in HF order.

The file is parsed here (header, metadata, tensor table) and memory-mapped; each tensor's raw
blocks are decoded by `store/gguf_quants.py`, so every type it knows works: F32/F16/BF16 as they
are, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as exact MLX affine triplets of group 32, K-quants dequantized.
The metadata comes back as plain Python values (str, int, float, bool, lists of them), ready for
a `.base` header. NOTE: `gguf.GGUFReader` reads the same data, but it builds a numpy view per
vocabulary string and takes seconds to open a 50k-token file; this parser takes a fraction of
one, and the tests check it against `GGUFReader`.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.gguf_quants import (
    EXACT_TYPES,
    FLOAT_TYPES,
    GROUP_SIZE,
    check_readable,
    dequantize_k,
    exact_record,
    float_record,
)

GGUF_GROUP_SIZE = GROUP_SIZE
# Kept under its GGUF name: it has no HF counterpart (HF configs describe llama 3 scaling in rope_scaling).
ROPE_FREQS = "rope_freqs.weight"
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF architecture -> HF model_type. Only architectures whose tensor layout we map.
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias|scales|biases)$")

# GGUF metadata value types: id -> struct format of a scalar (8 string, 9 array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


# ---------------------------------------------------------------------------------------------
# The file: metadata and tensor table


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the table: numpy-order shape (outermost first), type name, absolute offset."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def num_params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFFile:
    """An opened GGUF file: its metadata, its tensor table, and its bytes memory-mapped."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], data: mmap.mmap) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._data = data

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such GGUF file")
        try:
            with open(path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
        try:
            metadata, tensors = _Parser(data).parse()
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as exc:
            raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
        _check_extents(path, tensors, len(data))
        return cls(path, metadata, tensors, data)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, (num_bytes,) uint8, a view of the mapped file (nothing is copied)."""
        return np.frombuffer(self._data, dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    def release(self, info: TensorInfo) -> None:
        """Drops the tensor's mapped pages from this process's memory once it has been copied out
        (they stay in the page cache; reading the tensor again maps them back)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        self._data.madvise(mmap.MADV_DONTNEED, start, info.offset + info.num_bytes - start)

    def check_types(self) -> None:
        """A clear error if any tensor has a type base cannot read, before anything is converted."""
        for info in self.tensors.values():
            check_readable(info.type_name, info.name, self.path.name)
            if info.type_name in EXACT_TYPES and len(info.shape) != 2:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor {info.name!r} is a {len(info.shape)}-D {info.type_name} tensor; base "
                    "reads quantized tensors only as 2-D matrices"
                )

    def read(self, info: TensorInfo) -> TensorRecord | np.ndarray:
        """A float or exactly-kept quantized tensor as a record; a K-quant as dequantized float32 values."""
        raw = self.raw(info)
        if info.type_name in FLOAT_TYPES:
            return float_record(info.type_name, raw, info.shape)
        if info.type_name in EXACT_TYPES:
            return exact_record(info.type_name, raw, info.shape)
        check_readable(info.type_name, info.name, self.path.name)
        return dequantize_k(info.type_name, raw.reshape(info.shape[:-1] + (-1,)), info.shape)


class _Parser:
    """Reads the header, the metadata and the tensor table from the start of a mapped file."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

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
            metadata[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0:
            raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
        start = -(-self.pos // alignment) * alignment
        tensors = {
            name: TensorInfo(name, type_name, shape, start + offset, num_bytes)
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

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = self._scalar("I"), self._scalar("Q")
        if item_kind in _NUMPY:  # numbers in one read
            values = np.frombuffer(self.data, dtype=_NUMPY[item_kind], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.astype(bool).tolist() if item_kind == 7 else values.tolist()
        if item_kind == _STRING:
            return self._strings(count)
        return [self._value(item_kind) for _ in range(count)]

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
        num_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
        return name, kind.name, tuple(reversed(dims)), offset, num_bytes


def _check_extents(path: Path, tensors: dict[str, TensorInfo], file_size: int) -> None:
    for info in tensors.values():
        if info.offset + info.num_bytes > file_size:
            raise ModelFileError(f"{path}: tensor {info.name!r} runs past the end of the file (truncated download?)")


# ---------------------------------------------------------------------------------------------
# The mx.load-shaped view (direct loading): GGUF names, triplets as name.weight/.scales/.biases


def read_metadata(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """All tensors (GGUF names) and metadata of a GGUF file, with clear errors for unreadable files.

    Exact types come back as MLX triplets (`x.weight` uint32 codes, `x.scales`, `x.biases`,
    group 32); K-quants as float16 values (their dequantization rounded once more, to f16).
    """
    gguf_file = GGUFFile.open(path)
    gguf_file.check_types()
    tensors: dict[str, mx.array] = {}
    for name, info in gguf_file.tensors.items():
        value = gguf_file.read(info)
        if isinstance(value, np.ndarray):
            tensors[name] = mx.array(value).astype(mx.float16)
        elif value.bits is None:
            tensors[name] = mx.array(value.data).view(mx.bfloat16) if value.dtype == "bf16" else mx.array(value.data)
        else:
            prefix = name.removesuffix(".weight")
            tensors[name] = mx.array(value.codes)
            tensors[f"{prefix}.scales"] = mx.array(value.scales)
            tensors[f"{prefix}.biases"] = mx.array(value.biases)
        gguf_file.release(info)  # copied into MLX arrays: the mapped pages need not stay resident
    return tensors, gguf_file.metadata


def hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF config.json equivalent of a GGUF header."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "model_type": _ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length", hidden // num_heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = eos
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    missing = [k for k, v in config.items() if v is None]
    if missing:
        raise ModelFileError(f"GGUF metadata lacks {', '.join(missing)} for architecture {arch!r}")
    return config


def _unpermute_rows(w: Any, num_heads: int) -> Any:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs back to HF halves).

    The permutation moves whole rows, and quantization groups run along the input, so
    codes, scales and biases of a quantized tensor are all unpermuted the same way.
    Works on MLX and numpy arrays alike.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str, config: dict[str, Any]) -> tuple[str, int | None]:
    """(HF name, number of heads whose rows to unpermute or None) of a GGUF tensor name."""
    if name == ROPE_FREQS:  # llama 3's rope scaling, as per-frequency divisors; the loader hands it to the RoPE
        return name, None
    match = _NAME.match(name)
    base = match and (_LAYER_TENSORS if match.group(1) else _GLOBAL_TENSORS).get(match.group(2))
    if not base:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no known place in a {config['model_type']} model")
    layer, kind = match.group(1), match.group(3)
    heads = None
    if config["model_type"] == "llama" and match.group(2) in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if match.group(2) == "attn_q" else config["num_key_value_heads"]
    return (f"model.layers.{layer}.{base}.{kind}" if layer else f"{base}.{kind}"), heads


def hf_tensors(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors renamed to HF names, llama-family q/k rows back in HF order.

    `rope_freqs.weight` (llama 3 GGUFs: RoPE frequency divisors, one per rotary pair) keeps its name;
    `baselm.loader.model_from_checkpoint` hands it to the model's RoPE.
    """
    out = {}
    for name, value in tensors.items():
        target, heads = hf_name(name, config)
        out[target] = value if heads is None else _unpermute_rows(value, heads)
    return out


# ---------------------------------------------------------------------------------------------
# The streaming view (conversion): one tensor at a time, HF names, numpy


def hf_records(gguf_file: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, str, TensorRecord | np.ndarray]]:
    """(HF name, GGUF type, record or dequantized float32 values) per tensor, sorted by HF name.

    Each tensor is read from the mapped file only when the consumer asks for it.
    """
    names = sorted(gguf_file.tensors, key=lambda n: hf_name(n, config)[0])
    for name in names:
        info = gguf_file.tensors[name]
        target, heads = hf_name(name, config)
        value = gguf_file.read(info)
        if heads is not None:
            value = _unpermute_record(value, heads)
        yield target, info.type_name, value


def _unpermute_record(value: TensorRecord | np.ndarray, heads: int) -> TensorRecord | np.ndarray:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(_unpermute_rows(value, heads))
    parts = {k: getattr(value, k) for k in ("data", "codes", "scales", "biases")}
    moved = {k: None if v is None else np.ascontiguousarray(_unpermute_rows(v, heads)) for k, v in parts.items()}
    return TensorRecord(value.dtype, value.shape, group_size=value.group_size, scale_dtype=value.scale_dtype, **moved)
