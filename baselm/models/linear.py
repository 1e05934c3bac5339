"""Several linear projections of one input fused into one matmul (CPU decode is dispatch-bound)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def fused_linear(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """x (..., in) through a fused (weight, bias): (..., sum of out)."""
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def fuse_linears(linears: list[nn.Linear]) -> tuple[mx.array, mx.array | None]:
    """(weight, bias) of the stacked outputs; each linear's own arrays become views into them."""
    weight = mx.concatenate([lin.weight for lin in linears], axis=0)  # (sum of out, in)
    has_bias = "bias" in linears[0]
    bias = mx.concatenate([lin.bias for lin in linears]) if has_bias else None
    mx.eval([weight] if bias is None else [weight, bias])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = weight[start : start + rows]
        if has_bias:
            lin.bias = bias[start : start + rows]
        start += rows
    return weight, bias
