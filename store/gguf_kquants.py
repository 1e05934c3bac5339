"""GGUF K-quants as affine `.base` records: exact where an affine group of 32 can hold them, else
re-quantized with the error measured.

This is the form for the paths that run no K-quant kernel (a GPU, a sharded or adapted model, the
generic CPU build) and for a pull asked for a quant. `base pull` of a K-quant file stores its
matrices as their blocks instead (the `.base` block dtypes, baselm/gguf_blocks.py), and
`gguf.blocks_as_triplets` turns them into these records when such a path loads them; stacks of
matrices (MoE experts) become these records at pull.

A K-quant super-block holds 256 values of a row. What each type stores, and what it becomes:

    type  sub-blocks        value                         .base record (groups of 32)
    Q4_K  8 of 32           d*sc * q - dmin*m  (q 4-bit)  base_q4, scale d*sc, bias -dmin*m: exact
    Q5_K  8 of 32           d*sc * q - dmin*m  (q 5-bit)  base_q5, scale d*sc, bias -dmin*m: exact
    Q3_K  16 of 16          d*(sc-32) * (q-4)  (q 3-bit)  base_q8, scale d, bias -127d,
                                                          code (sc-32)*(q-4) + 127: exact
    Q6_K  16 of 16          d*sc * (q-32)      (q 6-bit)  base_q8 re-quantized (no exact form)
    Q2_K  16 of 16          d*sc * q - dmin*m  (q 2-bit)  base_q4 re-quantized (no exact form)

`sc` and `m` are small integers (6-bit in Q4_K/Q5_K, 4-bit in Q2_K, 8-bit in Q6_K), `d` and
`dmin` float16. Q4_K/Q5_K: `d*sc` and `dmin*m` are exact in float32 (at most 11 + 6 significant
bits), so `scale * q + bias` rounds the same single sum as llama.cpp's `d*sc*q - dmin*m`: the
values agree bit for bit. They are stored as float16 when every one of a tensor's scales and
biases is a float16 value, else as float32. Q3_K: two sub-blocks of 16 share a group of 32 but
not a scale; their common factor `d` does, and `(sc-32)*(q-4)` lies in [-124, 128], which an
8-bit code offset by 127 holds exactly (`d * code` and `-127d` are exact in float32, so is their
sum). Q6_K's products `sc*(q-32)` need 13 bits and Q2_K's two minimums per group differ, so no
affine group of 32 holds them (MLX's smallest group is 32); they are dequantized and quantized
again on a finer grid: Q6_K at 8 bits (a quarter of its own step), Q2_K at 4 bits. The caller
logs the measured error (`RequantError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.quantize import pack_codes, quantize, unpack_codes

GROUP_SIZE = 32
SUPER_BLOCK = 256
# K-quant -> (.base bits, whether it is kept exactly)
K_SCHEMES = {"Q2_K": (4, False), "Q3_K": (8, True), "Q4_K": (4, True), "Q5_K": (5, True), "Q6_K": (8, False)}
_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
Q3_K_OFFSET = 127
FLOAT_VIEW = {"f32": np.float32, "f16": np.float16}


@dataclass(slots=True)
class RequantError:
    """The error of re-quantizing one K-quant type, summed over the tensors of a file."""

    type_name: str
    bits: int
    num_values: int = 0
    sum_sq_error: float = 0.0
    sum_sq_value: float = 0.0
    max_error: float = 0.0
    tensors: list[str] = field(default_factory=list)

    def add(self, name: str, values: np.ndarray, stored: np.ndarray) -> None:
        error = (stored - values).reshape(-1)
        flat = values.reshape(-1)
        self.num_values += values.size
        # Sums of squares in float64 without a float64 copy of the values (einsum casts as it goes).
        self.sum_sq_error += float(np.einsum("i,i->", error, error, dtype=np.float64))
        self.sum_sq_value += float(np.einsum("i,i->", flat, flat, dtype=np.float64))
        self.max_error = max(self.max_error, float(np.abs(error).max(initial=0.0)))
        if name not in self.tensors:  # a large tensor comes in several chunks of rows
            self.tensors.append(name)

    def merge(self, other: RequantError) -> None:
        """Adds the errors `other` measured (tensors of the same type, read apart) to these."""
        self.num_values += other.num_values
        self.sum_sq_error += other.sum_sq_error
        self.sum_sq_value += other.sum_sq_value
        self.max_error = max(self.max_error, other.max_error)
        self.tensors += [name for name in other.tensors if name not in self.tensors]

    @property
    def relative_rms(self) -> float:
        """RMS error over the RMS of the weights (0 for all-zero weights)."""
        return float(np.sqrt(self.sum_sq_error / self.sum_sq_value)) if self.sum_sq_value else 0.0

    def describe(self) -> str:
        return (
            f"{len(self.tensors)} {self.type_name} tensor(s) have no exact affine form and were requantized to "
            f"q{self.bits} (groups of {GROUP_SIZE}): RMS error {100 * self.relative_rms:.3f}% of the weights' RMS, "
            f"largest error {self.max_error:.3g}"
        )


def is_exact(type_name: str) -> bool:
    return K_SCHEMES[type_name][1]


# Rows decoded at a time: bounds the float32 intermediates of a large tensor (a 262k-token embedding)
# and keeps them in the CPU's cache, which makes the dozen passes over them several times faster.
CHUNK_VALUES = 1 << 18


def k_record(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
    """An exactly-kept K-quant (Q3_K, Q4_K, Q5_K) tensor's raw bytes (rows, bytes) as a `.base` record."""
    if type_name == "Q3_K":
        return by_rows(raw, shape, _q3_record)
    bits = K_SCHEMES[type_name][0]

    def decode(part: np.ndarray, part_shape: tuple[int, int]) -> TensorRecord:
        blocks = part.reshape(part_shape[0], part_shape[1] // SUPER_BLOCK, _BLOCK_BYTES[type_name])  # (rows, n, B)
        scales, biases, q = _q45_fields(type_name, blocks)  # (rows, cols/32) x2, (rows, cols) uint8
        return exact_affine_record(bits, part_shape, q, scales, biases)

    return by_rows(raw, shape, decode)


def requantized_record(name: str, raw: np.ndarray, shape: tuple[int, int], error: RequantError) -> TensorRecord:
    """A Q2_K/Q6_K tensor dequantized as llama.cpp does and quantized again; adds its error to `error`."""

    def requantize(part: np.ndarray, part_shape: tuple[int, int]) -> TensorRecord:
        values = k_values(error.type_name, part, part_shape)  # (rows, cols) float32
        record = quantize(values, error.bits, GROUP_SIZE, "f16", name)
        error.add(name, values, _dequantized(record))
        return record

    return by_rows(raw, shape, requantize)


def by_rows(
    raw: np.ndarray, shape: tuple[int, int], fn: Callable[[np.ndarray, tuple[int, int]], TensorRecord]
) -> TensorRecord:
    """`fn(raw rows, their shape)` over chunks of rows, the records stacked back into one."""
    rows, cols = shape
    raw = raw.reshape(rows, -1)  # (rows, row bytes)
    step = max(1, CHUNK_VALUES // cols)
    parts = [fn(raw[start : start + step], (min(step, rows - start), cols)) for start in range(0, rows, step)]
    if len(parts) == 1:
        return parts[0]
    scale_dtype = "f32" if any(p.scale_dtype == "f32" for p in parts) else parts[0].scale_dtype
    kind = {"f32": np.float32, "f16": np.float16}[scale_dtype]
    stacked = {
        "codes": np.concatenate([p.codes for p in parts]),
        "scales": np.concatenate([p.scales.view(FLOAT_VIEW[p.scale_dtype]).astype(kind) for p in parts]),
        "biases": np.concatenate([p.biases.view(FLOAT_VIEW[p.scale_dtype]).astype(kind) for p in parts]),
    }
    first = parts[0]
    return TensorRecord(first.dtype, shape, group_size=first.group_size, scale_dtype=scale_dtype, **stacked)


def k_values(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A K-quant tensor as float32 values, by the `gguf` package's own dequantization."""
    with np.errstate(invalid="ignore", over="ignore"):  # a corrupt block's inf/nan is caught by the caller
        values = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name])
    return values.reshape(shape).astype(np.float32, copy=False)


def _q45_fields(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales d*sc, biases -dmin*m as float32 (rows, cols/32), codes uint8 (rows, cols)) of Q4_K/Q5_K blocks."""
    rows, num_blocks, _ = blocks.shape
    flat = blocks.reshape(rows * num_blocks, -1)
    d = np.ascontiguousarray(flat[:, 0:2]).view("<f2").astype(np.float32)  # (rows * n, 1)
    dmin = np.ascontiguousarray(flat[:, 2:4]).view("<f2").astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(flat[:, 4:16]))  # (rows * n, 8) each
    scales = d * sc.astype(np.float32)
    biases = -(dmin * m.astype(np.float32))
    at = 16
    high = None
    if type_name == "Q5_K":
        qh = flat[:, at : at + 32]  # (rows * n, 32): bit k of byte l is bit 4 of value l of sub-block k
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # (rows * n, 8, 32)
        at += 32
    qs = flat[:, at : at + 128].reshape(-1, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
    q = ((qs >> np.array([0, 4], dtype=np.uint8)[None, None, :, None]) & np.uint8(0x0F)).reshape(-1, 8, 32)
    if high is not None:
        q = q | (high << np.uint8(4))
    return scales.reshape(rows, -1), biases.reshape(rows, -1), q.reshape(rows, -1)


def _q3_record(raw: np.ndarray, shape: tuple[int, int]) -> TensorRecord:
    """Q3_K as 8-bit codes over the super-block's `d`: every value is `d` times an integer in [-124, 128]."""
    rows, cols = shape
    blocks = raw.reshape(rows, cols // SUPER_BLOCK, _BLOCK_BYTES["Q3_K"])
    d = np.ascontiguousarray(blocks[..., 108:110]).view("<f2")[..., 0].astype(np.float32)  # (rows, n)
    values = k_values("Q3_K", raw, shape).reshape(rows, -1, SUPER_BLOCK)  # (rows, n, 256)
    safe_d = np.where(d == 0, np.float32(1), d)[..., None]
    with np.errstate(invalid="ignore"):
        products = np.rint(values / safe_d)  # exact: each value is d times a small integer
    if not np.array_equal(products * safe_d, values) or not (-Q3_K_OFFSET <= products).all() or (products > 128).any():
        raise ValueError("a Q3_K block does not hold d times an integer in [-124, 128]; the file is corrupt")
    codes = (products + Q3_K_OFFSET).astype(np.uint8).reshape(rows, cols)
    scales = np.repeat(d, SUPER_BLOCK // GROUP_SIZE, axis=1)  # (rows, cols / 32)
    return exact_affine_record(8, shape, codes, scales, scales * np.float32(-Q3_K_OFFSET))


def exact_affine_record(
    bits: int, shape: tuple[int, int], q: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> TensorRecord:
    """An affine record of codes and float32 scales/biases, stored as float16 when that loses nothing."""
    scale_dtype = "f32"
    with np.errstate(over="ignore"):
        s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
    if np.array_equal(s16.astype(np.float32), scales) and np.array_equal(b16.astype(np.float32), biases):
        scales, biases, scale_dtype = s16, b16, "f16"
    return TensorRecord(
        dtype=f"base_q{bits}",
        shape=shape,
        codes=pack_codes(q, bits),
        scales=np.ascontiguousarray(scales),
        biases=np.ascontiguousarray(biases),
        group_size=GROUP_SIZE,
        scale_dtype=scale_dtype,
    )


def _dequantized(record: TensorRecord) -> np.ndarray:
    """A re-quantized record's float32 values, `scale * q + bias` per group (in numpy: MLX's CPU
    dequantize, evaluated one chunk at a time, took several times longer)."""
    rows, cols = record.shape
    q = unpack_codes(record.codes, record.bits).reshape(rows, -1, record.group_size)  # (rows, groups, g)
    scales, biases = (to_float32(a, record.scale_dtype)[..., None] for a in (record.scales, record.biases))
    return (q * scales + biases).reshape(rows, cols)  # uint8 * float32: float32
