"""LoRA adapters at run time: each projection adds, for the rows of the requests that run with an
adapter, that adapter's low-rank delta on top of whatever its own weights computed.

    y = W x                                 every row, by the layer as it is (float, quantized, kernels)
    y[rows_a] += scale_row * (x[rows_a] @ a_a) @ b_a    for each adapter a in the step

`a` (in, r) and `b` (r, out) are float32, the adapter's factor (alpha / r, mlx-lm's scale) already
in `b`; which rows each adapter takes, and their scales, come with the step's metadata
(`AttentionMetadata.adapter_rows`), built by the runner. Rows no adapter names are never written:
a plain request's output is the layer's own, bit for bit.

The projections that take adapters are those a module lists in its `lora_projections` (the
attention's q/k/v/o, the dense MLP's gate/up/down); fused q/k/v and gate/up matmuls stay fused
(each part's delta is added after the split).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from baselm.metal import AttentionMetadata
from baselm.models.base import ModelConfigError


class LoRAFactors:
    """One projection's adapters by slot: (a (in, r), b (r, out)) each, float32, b scaled by the
    adapter's factor. Held as a plain attribute of the projection (not a parameter of the model)."""

    __slots__ = ("by_slot",)

    def __init__(self) -> None:
        self.by_slot: dict[int, tuple[mx.array, mx.array]] = {}


def add_lora(linear: nn.Module, x: mx.array, y: mx.array, meta: AttentionMetadata | None) -> mx.array:
    """`y` = linear(x) (num_tokens, out) with the delta of each adapter of the step that `linear`
    has, on that adapter's rows; `y` itself when the step runs no adapter `linear` has."""
    if meta is None or not meta.adapter_rows:
        return y
    lora = linear.__dict__.get("lora")
    if lora is None:
        return y
    for group in meta.adapter_rows:
        factors = lora.by_slot.get(group.slot)
        if factors is None:
            continue
        a, b = factors
        down = (x[group.rows].astype(mx.float32) @ a) * group.scales  # (num_rows, r)
        y = y.at[group.rows].add((down @ b).astype(y.dtype))  # (num_rows, out) added to those rows only
    return y


def projection(model: nn.Module, name: str) -> nn.Module:
    """The linear layer of `model` an adapter names (HF's name, without `.weight`), or a
    ModelConfigError saying why it takes no adapter at run time."""
    path = name.removeprefix("model.")
    parent_path, _, leaf = path.rpartition(".")
    parent = dict(model.named_modules()).get(parent_path)
    if parent is None or leaf not in getattr(parent, "lora_projections", ()):
        raise ModelConfigError(
            f"it adapts {name}, and adapters served per request apply to the attention's q/k/v/o and the dense "
            "MLP's gate/up/down projections only; merge it as the model loads instead (--adapter)"
        )
    return getattr(parent, leaf)


def attach(linear: nn.Module, slot: int, a: mx.array, b: mx.array) -> None:
    """Gives `linear` the adapter in `slot`: a (in, r), b (r, out), both float32, b with the factor in it."""
    lora = linear.__dict__.get("lora")
    if lora is None:
        lora = linear.__dict__["lora"] = LoRAFactors()
    lora.by_slot[slot] = (a, b)
