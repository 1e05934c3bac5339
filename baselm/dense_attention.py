"""Attention without a KV cache, as the vision towers run it: each query row of a segment over
every key row of that segment, in both directions (one segment: the whole sequence).

On the CPU the compiled kernel (csrc/dense_attention.cpp) serves it: an online softmax over 64
keys at a time, never a score matrix of the whole image. MLX's CPU backend computes that matrix
per head and softmaxes it, seconds a layer at 4,096 patches (one softmax of SigLIP's 16 heads
alone took 8.5 s); the kernel takes a fraction of that. Elsewhere (a GPU, float16 inputs, no
kernels built) `dense_attention_reference` runs: `mx.fast.scaled_dot_product_attention` per
segment, the kernel's oracle in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from baselm import cpu


def kernel_applies(queries: mx.array) -> bool:
    """Whether the CPU kernel serves dense attention of these queries."""
    return cpu.kernels is not None and mx.default_device() == mx.cpu and queries.dtype == mx.float32


def dense_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, segments: Sequence[int] | None = None
) -> mx.array:
    """(seq, heads, head_dim) attention output of queries, keys and values of that shape; `segments`
    (0, ..., seq) bounds the groups of rows that see each other (None: all rows see all rows)."""
    bounds = _bounds(segments, queries.shape[0])
    if kernel_applies(queries) and keys.dtype == values.dtype == mx.float32:
        return cpu.kernels.dense_attention(queries, keys, values, float(scale), mx.array(bounds, dtype=mx.int32))
    return dense_attention_reference(queries, keys, values, scale, bounds)


def dense_attention_reference(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, segments: Sequence[int] | None = None
) -> mx.array:
    """The same maths with MLX's own attention op, one call per segment."""
    bounds = _bounds(segments, queries.shape[0])

    def heads_first(t: mx.array, a: int, b: int) -> mx.array:  # (1, heads, b - a, head_dim)
        return t[a:b].transpose(1, 0, 2)[None]

    parts = [
        mx.fast.scaled_dot_product_attention(
            heads_first(queries, a, b), heads_first(keys, a, b), heads_first(values, a, b), scale=scale
        )[0].transpose(1, 0, 2)
        for a, b in zip(bounds, bounds[1:])
        if b > a
    ]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def _bounds(segments: Sequence[int] | None, seq_len: int) -> list[int]:
    bounds = [0, seq_len] if segments is None else [int(b) for b in segments]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"segments must ascend from 0 to the sequence length {seq_len}, not {bounds}")
    return bounds
