"""gpt-oss experts as llama.cpp's converter splits them, fused back into the HF checkpoint's tensors.

HF keeps each layer's experts stacked and fused: `gate_up_proj` (experts, hidden, 2 * inter) with
gate and up interleaved along the last axis, `gate_up_proj_bias` (experts, 2 * inter) likewise,
`down_proj` (experts, inter, hidden) and `down_proj_bias` (experts, hidden). The converter writes
`ffn_gate_exps`/`ffn_up_exps` (experts, inter, hidden), `ffn_down_exps` (experts, hidden, inter)
and their biases. Putting them back moves values only, so floats (and MXFP4, read as floats)
come back exactly; quantized affine experts are dequantized to float32 first, since HF's
(in, out) layout cannot hold their row-wise groups.
"""

from __future__ import annotations

import numpy as np

from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.quantize import dequantize_record

# The GGUF parts each fused HF tensor is made of.
PARTS = {"gate_up": ("gate", "up"), "down": ("down",)}


def fused_record(kind: str, parts: dict[str, tuple[TensorRecord, tuple[int, ...]]]) -> TensorRecord:
    """The HF tensor `kind` ("gate_up" or "down", weight or bias by rank) from its GGUF parts, each
    (record, GGUF shape in numpy order)."""
    arrays, dtype = _same_dtype([_values(*parts[p]) for p in PARTS[kind]])
    if kind == "down":
        (down,) = arrays
        fused = (
            down if down.ndim == 2 else down.swapaxes(1, 2)
        )  # bias as is; (experts, hidden, inter) -> (.., inter, hidden)
    else:
        gate, up = arrays
        fused = np.stack([gate, up], axis=2)  # (experts, inter, 2[, hidden]): gate and up interleaved
        fused = fused.reshape(gate.shape[0], -1) if gate.ndim == 2 else fused.reshape(gate.shape[0], -1, gate.shape[2])
        fused = fused if fused.ndim == 2 else fused.swapaxes(1, 2)  # (experts, hidden, 2 * inter)
    return TensorRecord(dtype, tuple(fused.shape), data=np.ascontiguousarray(fused))


def _values(record: TensorRecord, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """(stored values in `shape`, dtype): floats as stored (bf16 as its bits), quantized ones in float32."""
    if record.bits is None:
        return record.data.reshape(shape), record.dtype
    return np.array(dequantize_record(record)).reshape(shape), "f32"


def _same_dtype(values: list[tuple[np.ndarray, str]]) -> tuple[list[np.ndarray], str]:
    dtypes = {dtype for _, dtype in values}
    if len(dtypes) == 1:
        return [array for array, _ in values], dtypes.pop()
    return [to_float32(array, dtype) for array, dtype in values], "f32"
