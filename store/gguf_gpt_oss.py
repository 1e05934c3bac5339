"""gpt-oss experts as llama.cpp's converter splits them, fused back into the HF checkpoint's tensors.

HF keeps each layer's experts stacked and fused: `gate_up_proj` (experts, hidden, 2 * inter) with
gate and up interleaved along the last axis, `gate_up_proj_bias` (experts, 2 * inter) likewise,
`down_proj` (experts, inter, hidden) and `down_proj_bias` (experts, hidden). The converter writes
`ffn_gate_exps`/`ffn_up_exps` (experts, inter, hidden), `ffn_down_exps` (experts, hidden, inter)
and their biases. Putting them back moves values only, so floats (and MXFP4, read as floats)
come back exactly; quantized affine experts are dequantized to float32 first, since HF's
(in, out) layout cannot hold their row-wise groups. MXFP4 experts can also come back as HF
stores them (`hf_mxfp4`): `_blocks`/`_scales` in HF's (experts, out, ...) row order, exactly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError
from baselm.store.mxfp4 import GGUF_BLOCK_BYTES
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
    if record.bits is None and record.block_type is None:
        return record.data.reshape(shape), record.dtype
    return np.array(dequantize_record(record)).reshape(shape), "f32"


def _same_dtype(values: list[tuple[np.ndarray, str]]) -> tuple[list[np.ndarray], str]:
    dtypes = {dtype for _, dtype in values}
    if len(dtypes) == 1:
        return [array for array, _ in values], dtypes.pop()
    return [to_float32(array, dtype) for array, dtype in values], "f32"


def hf_mxfp4(hf_name: str, parts: dict[str, tuple[np.ndarray, tuple[int, ...]]]) -> dict[str, mx.array]:
    """HF's `{hf_name}_blocks` (experts, out, in / 32, 16) and `_scales` (experts, out, in / 32) uint8
    from the GGUF MXFP4 parts, each (raw bytes, GGUF shape (experts, out, in)): gate and up rows
    interleaved as HF keeps them, ggml's code order (j and j + 16 in byte j) back to HF's (2j, 2j + 1)."""
    kind = "down" if "down" in parts else "gate_up"
    if set(parts) != set(PARTS[kind]):
        raise ModelFileError(f"{hf_name} lacks its gate or up experts")
    blocks, scales = [], []
    for part in PARTS[kind]:
        raw, (num_experts, rows, inputs) = parts[part]
        ggml = raw.reshape(num_experts, rows, inputs // 32, GGUF_BLOCK_BYTES)
        codes = np.concatenate([ggml[..., 1:] & np.uint8(0x0F), ggml[..., 1:] >> np.uint8(4)], axis=-1)  # (.., 32)
        blocks.append(codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4)))  # (experts, rows, groups, 16)
        scales.append(ggml[..., 0])  # (experts, rows, groups)
    if kind == "gate_up":  # rows gate 0, up 0, gate 1, up 1, ...
        blocks = [np.stack(blocks, axis=2).reshape(blocks[0].shape[0], -1, *blocks[0].shape[2:])]
        scales = [np.stack(scales, axis=2).reshape(scales[0].shape[0], -1, scales[0].shape[2])]
    return {f"{hf_name}_blocks": mx.array(blocks[0]), f"{hf_name}_scales": mx.array(scales[0])}
