"""A GGUF tensor's record put back in HF layout: stacked experts split, llama.cpp's q/k row
permutation undone, Gemma's `1 + w` norms shifted back (store/gguf.py reads, this moves rows)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError
from baselm.store.gguf_arch import Placement


def put_back(record: TensorRecord, where: Placement) -> Iterator[tuple[str, TensorRecord]]:
    """The HF tensor(s) of one GGUF tensor: experts split, q/k rows unpermuted, Gemma norms shifted."""
    parts = _split_rows(record, where.num_experts) if where.num_experts else [record]
    for expert, part in enumerate(parts):
        if where.unpermute_heads:
            part = _map_rows(part, lambda rows: unpermute_rows(rows, where.unpermute_heads))
        if where.norm_shift:
            part = _shifted(part, where.norm_shift)
        yield where.hf_name.replace("{e}", str(expert)), part


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs back to HF halves).

    The permutation moves whole rows, and quantization groups run along the input, so codes,
    scales and biases of a quantized tensor are all unpermuted the same way.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _map_rows(record: TensorRecord, fn: Any) -> TensorRecord:
    """`record` with `fn` applied to the rows of its values, or of its codes, scales and biases alike."""
    moved = {
        k: None if getattr(record, k) is None else np.ascontiguousarray(fn(getattr(record, k)))
        for k in ("data", "codes", "scales", "biases")
    }
    return TensorRecord(
        record.dtype, record.shape, group_size=record.group_size, scale_dtype=record.scale_dtype, **moved
    )


def _split_rows(record: TensorRecord, num_parts: int) -> list[TensorRecord]:
    """A stack of `num_parts` matrices (experts) as one record each, (rows / num_parts, inputs)."""
    if record.bits is None:
        data = record.data.reshape(num_parts, -1, record.shape[-1])
        return [TensorRecord(record.dtype, tuple(part.shape), data=np.ascontiguousarray(part)) for part in data]
    rows = record.shape[0] // num_parts
    return [
        TensorRecord(
            record.dtype,
            (rows, record.shape[1]),
            **{
                k: np.ascontiguousarray(getattr(record, k)[e * rows : (e + 1) * rows])
                for k in ("codes", "scales", "biases")
            },
            group_size=record.group_size,
            scale_dtype=record.scale_dtype,
        )
        for e in range(num_parts)
    ]


def _shifted(record: TensorRecord, shift: float) -> TensorRecord:
    """A float norm weight less `shift`, in float32 (Gemma GGUFs store `1 + w`, HF stores `w`)."""
    if record.bits is not None:
        raise ModelFileError(f"a norm weight of shape {list(record.shape)} is quantized; GGUF norms are float")
    values = to_float32(record.data, record.dtype) - np.float32(shift)
    return TensorRecord("f32", record.shape, data=np.ascontiguousarray(values, dtype=np.float32))
