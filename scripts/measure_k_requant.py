"""Measures what re-quantizing Q2_K and Q6_K tensors costs, on K-quant blocks made from normal weights.

    python scripts/measure_k_requant.py [rows] [cols]

The `gguf` package cannot quantize K-quants, so this builds Q2_K and Q6_K blocks from standard
normal weights with a plain max-abs quantizer (llama.cpp searches scales more carefully; its own
error is a little lower), checks them through the package's dequantizer, and reports two relative
RMS errors: the K-quant's own (against the normal weights) and what `.base`'s re-quantization adds
(against the K-quant's values, as `base pull` reports it).
"""

from __future__ import annotations

import sys

import numpy as np

from baselm.store.gguf_kquants import RequantError, k_values, requantized_record


def _rint(x: np.ndarray, low: int, high: int) -> np.ndarray:
    return np.clip(np.rint(x), low, high).astype(np.int32)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows, cols / 256 * 210) Q6_K blocks: 16 sub-blocks of 16, int8 scales."""
    sub = w.reshape(-1, 16, 16)  # (blocks, sub-block, value)
    scales = np.abs(sub).max(-1) / 31  # (blocks, 16)
    d = (scales.max(-1) / 127).astype(np.float16)  # (blocks,)
    d32 = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    sc = _rint(scales / d32, -128, 127)
    step = d32[..., None] * np.where(sc == 0, 1, sc)[..., None]
    q = (_rint(sub / step, -32, 31) + 32).reshape(-1, 2, 4, 32)  # value n*128 + k*32 + l
    ql = np.concatenate(
        [(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], -1
    )
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4))  # (blocks, 2, 32)
    parts = [
        ql.reshape(-1, 128),
        qh.reshape(-1, 64),
        sc.astype(np.int8).view(np.uint8),
        d.view(np.uint8).reshape(-1, 2),
    ]
    return np.concatenate([p.astype(np.uint8) for p in parts], -1).reshape(w.shape[0], -1)


def q2_k_blocks(w: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows, cols / 256 * 84) Q2_K blocks: 16 sub-blocks of 16, 4-bit scale and min."""
    sub = w.reshape(-1, 16, 16)
    mins = np.maximum(-sub.min(-1), 0)  # (blocks, 16): x ~ dl * q - ml
    steps = (sub.max(-1) + mins) / 3
    d, dmin = (steps.max(-1) / 15).astype(np.float16), (mins.max(-1) / 15).astype(np.float16)
    d32, dmin32 = (np.where(v == 0, 1, v.astype(np.float32))[:, None] for v in (d, dmin))
    sc, m = _rint(steps / d32, 0, 15), _rint(mins / dmin32, 0, 15)
    dl = d32 * np.where(sc == 0, 1, sc)
    q = _rint((sub + (dmin32 * m)[..., None]) / dl[..., None], 0, 3).reshape(-1, 2, 4, 32)  # n*128 + j*32 + l
    qs = sum(q[:, :, j] << (2 * j) for j in range(4))  # (blocks, 2, 32)
    parts = [sc | (m << 4), qs.reshape(-1, 64), d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    return np.concatenate([p.astype(np.uint8) for p in parts], -1).reshape(w.shape[0], -1)


def main(rows: int = 512, cols: int = 2048) -> None:
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    for type_name, make in (("Q6_K", q6_k_blocks), ("Q2_K", q2_k_blocks)):
        raw = make(w)
        error = RequantError(type_name, 8 if type_name == "Q6_K" else 4)
        requantized_record("w", raw, (rows, cols), error)
        own = np.sqrt(np.square(k_values(type_name, raw, (rows, cols)) - w).mean() / np.square(w).mean())
        print(f"{type_name}: own error {100 * own:.2f}% RMS; {error.describe()}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
