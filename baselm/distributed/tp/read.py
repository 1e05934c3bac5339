"""Which bytes of a `.base` file one tensor-parallel rank reads, and how its split weights are made of them.

The plan is made before any tensor is read: a skeleton of the model (its parameters are lazy and
never evaluated) gives the split layers, `Sharding.plan` the cut of each (rows or columns of its
weight), and a trace of the model's own `sanitize` (baselm/distributed/tp/trace.py) the file rows or
columns each row or column of those weights is. A rank reads, of each file tensor that split
weights alone are made of, the ranges its cuts take: one for a renamed tensor or a per-expert
one, several for a fused one (phi3's q, k and v rows of `qkv_proj`). `ReadPlan.assemble` then
puts each weight together from its ranges, transposed where the file stores it transposed
(gpt-oss's experts) and stacked where per-expert tensors are, and hands it on under the model's
own name beside the file's other tensors, which `sanitize` maps as usual.

Per layer: a weight the trace cannot follow, or whose file tensor something else is also made
of, is read whole and sliced after loading, as GGUF files and HF folders always are. Quantized
tensors are cut on rows, or on columns at their quantization groups, and stay quantized. A
planned cut that splits a quantized weight's groups reads the whole file, so that widened dense
weights can still be split on any feature.
Ranges are planned on the quantization groups also when the weights are widened to float after
loading (the CPU without kernels), where load-then-slice splits an MLP on any feature: an uneven
split (features not a multiple of ranks x group) may then differ from load-then-slice's, both valid.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.distributed.tp.trace import AxisSource, Trace, passes_through, skeleton_shapes, trace_sources
from baselm.models import model_class
from baselm.models.base import ModelConfigError
from baselm.store.base_header import TensorEntry
from baselm.store.base_reader import BaseFile, QuantizedArray
from baselm.store.base_slices import Cut, cut_fits

Piece = tuple[str, int, int]  # (file tensor, start, stop) along the layer's file axis
Tensor = mx.array | QuantizedArray


@dataclass(frozen=True, slots=True)
class LayerRead:
    """How one rank's cut of a split weight is made of file ranges."""

    pieces: tuple[tuple[Piece, ...], ...]  # per leading position: its ranges, joined in order
    file_axis: int  # the file tensors' axis the ranges are on
    transposed: bool  # the weight's cut axis is the other axis of the file tensors
    lead: tuple[int, ...]  # leading axes the positions are stacked into (per-expert tensors); ()

    def names(self) -> set[str]:
        return {name for pieces in self.pieces for name, _, _ in pieces}


@dataclass(slots=True)
class ReadPlan:
    """A rank's reads of a `.base` file: empty when it reads every tensor whole."""

    cuts: dict[str, Cut] = field(default_factory=dict)  # module path -> cut of its weight (the hook's ranges)
    reads: dict[str, list[Cut]] = field(default_factory=dict)  # file tensor -> its ranges read, in order
    layers: dict[str, LayerRead] = field(default_factory=dict)  # module path -> how its weight is made
    # module path -> the file tensors stacked into its weight, one per leading position (per-expert
    # tensors), whether or not it is cut: what whole experts per rank may leave unread (tp_moe.py)
    stacked: dict[str, list[str]] = field(default_factory=dict)

    def assemble(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The loaded tensors with the cut file tensors replaced by the weights made of them."""
        out = {name: value for name, value in tensors.items() if name not in self.reads}
        for path, layer in self.layers.items():
            out[f"{path}.weight"] = _assemble(layer, tensors, self.reads)
        return out


def plan_reads(base: BaseFile, sharding: Any) -> ReadPlan:
    """This rank's `ReadPlan` of `base` (see the module doc)."""
    model = skeleton(base)
    trace = trace_sources(model, base.tensors)
    stacked = {path: list(source.names) for (path, _), source in trace.sources.items() if len(source.names) > 1}
    plan = _plan(base, sharding, model, trace)
    plan.stacked = stacked
    return plan


def skeleton(base: BaseFile) -> Any:
    """The model of `base`'s config with lazy parameters that are never evaluated (no memory)."""
    config = base.header["config"]
    args_cls, model_cls = model_class(config.get("model_type", ""))
    return model_cls(args_cls.from_dict(config))


def _plan(base: BaseFile, sharding: Any, model: Any, trace: Trace) -> ReadPlan:
    feeds = trace.feeds()
    group_sizes = {path: base.tensors[names[0]].group_size or 1 for path, names in feeds.items()}
    try:
        planned = sharding.plan(model, group_sizes)
    except ModelConfigError:  # a split off the groups: loading whole lets the hook say so, or split dense weights
        return ReadPlan()
    if not _on_groups(planned, feeds, base.tensors):
        return ReadPlan()
    layers = {}
    for path, cut in planned.items():
        layer = _layer_read(trace.sources.get((path, cut.axis)), cut, base.tensors)
        if layer is not None and layer.names() == set(feeds[path]):
            layers[path] = layer
    layers = _exclusive(layers, trace)
    reads = _reads(layers)
    shapes = skeleton_shapes(model)
    given = {f"{path}.weight": _cut_shape(shapes[f"{path}.weight"], planned[path]) for path in layers}
    kept = {name: entry for name, entry in base.tensors.items() if name not in reads}
    if not layers or not passes_through(model, kept, given):
        return ReadPlan()
    return ReadPlan({path: planned[path] for path in layers}, reads, layers)


def _on_groups(planned: dict[str, Cut], feeds: dict[str, list[str]], entries: dict[str, TensorEntry]) -> bool:
    """Whether every planned column cut of a quantized weight falls on its groups."""
    for path, cut in planned.items():
        for name in feeds.get(path, []) if cut.axis == -1 else []:
            group = entries[name].group_size
            if entries[name].bits is not None and (cut.start % group or cut.stop % group):
                return False
    return True


def _layer_read(source: AxisSource | None, cut: Cut, entries: dict[str, TensorEntry]) -> LayerRead | None:
    """The ranges `cut` takes of the file tensors `source` names, or None when they cannot be read
    as they are stored (a quantized tensor transposed, or cut off its groups)."""
    if source is None:
        return None
    transposed = source.file_axis != cut.axis
    positions = []
    for name, line in zip(source.names, source.indices):
        runs = _runs(line[cut.start : cut.stop])
        entry = entries[name]
        if entry.bits is not None and transposed:
            return None
        if not all(cut_fits(entry, Cut(source.file_axis, a, b)) for a, b in runs):
            return None
        positions.append(tuple((name, a, b) for a, b in runs))
    return LayerRead(tuple(positions), source.file_axis, transposed, source.lead)


def _runs(line: np.ndarray) -> list[tuple[int, int]]:
    """`line` (indices) as [start, stop) ranges of consecutive indices, in order."""
    breaks = (np.flatnonzero(np.diff(line) != 1) + 1).tolist()
    bounds = [0, *breaks, len(line)]
    return [(int(line[a]), int(line[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]


def _exclusive(layers: dict[str, LayerRead], trace: Trace) -> dict[str, LayerRead]:
    """The layers whose file tensors nothing but cut layers are made of, each on one axis."""
    while True:
        keys = {f"{path}.weight" for path in layers}
        axes: dict[str, set[int]] = defaultdict(set)
        for layer in layers.values():
            for name in layer.names():
                axes[name].add(layer.file_axis)
        shared = {name for name, on in axes.items() if len(on) > 1 or not trace.uses[name] <= keys}
        kept = {path: layer for path, layer in layers.items() if not layer.names() & shared}
        if len(kept) == len(layers):
            return kept
        layers = kept


def _reads(layers: dict[str, LayerRead]) -> dict[str, list[Cut]]:
    """File tensor -> the ranges read of it: its layers' ranges in order, overlaps and neighbours merged."""
    spans: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for layer in layers.values():
        for pieces in layer.pieces:
            for name, start, stop in pieces:
                spans[name].append((layer.file_axis, start, stop))
    reads: dict[str, list[Cut]] = {}
    for name, items in spans.items():
        merged: list[Cut] = []
        for axis, start, stop in sorted(items):
            if merged and start <= merged[-1].stop:
                merged[-1] = Cut(axis, merged[-1].start, max(stop, merged[-1].stop))
            else:
                merged.append(Cut(axis, start, stop))
        reads[name] = merged
    return reads


def _cut_shape(shape: tuple[int, ...], cut: Cut) -> tuple[int, ...]:
    out = list(shape)
    out[cut.axis] = cut.stop - cut.start
    return tuple(out)


# ---- putting the weights together ----------------------------------------------------------


def _assemble(layer: LayerRead, tensors: dict[str, Tensor], reads: dict[str, list[Cut]]) -> Tensor:
    """A weight from its pieces of the tensors as read (each the concatenation of its `reads`)."""
    parts = []
    for pieces in layer.pieces:
        taken = [
            _take(tensors[name], layer.file_axis, _position(reads[name], start), stop - start)
            for name, start, stop in pieces
        ]
        part = taken[0] if len(taken) == 1 else _join(taken, layer.file_axis)
        parts.append(mx.contiguous(part.swapaxes(-1, -2)) if layer.transposed else part)  # float only
    return _stack(parts, layer.lead) if layer.lead else parts[0]


def _position(ranges: list[Cut], index: int) -> int:
    """Where file index `index` is in the concatenation of `ranges`."""
    offset = 0
    for cut in ranges:
        if cut.start <= index < cut.stop:
            return offset + index - cut.start
        offset += cut.stop - cut.start
    raise ValueError(f"index {index} is outside the ranges read {ranges}")


def _take(value: Tensor, axis: int, start: int, length: int) -> Tensor:
    """`length` rows (axis -2) or columns (-1) of `value` from `start`, each array in a buffer of its
    own (as the hook's slices); quantized columns on groups."""
    if start == 0 and length == value.shape[axis]:
        return value
    if not isinstance(value, QuantizedArray):
        view = value[..., start : start + length, :] if axis == -2 else value[..., start : start + length]
        return mx.contiguous(view)
    shape = list(value.shape)
    shape[axis] = length
    if axis == -2:
        rows = [mx.contiguous(a[..., start : start + length, :]) for a in (value.codes, value.scales, value.biases)]
        return QuantizedArray(*rows, value.bits, value.group_size, tuple(shape))
    words, group = value.bits * start // 32, value.group_size
    codes = mx.contiguous(value.codes[..., words : words + value.bits * length // 32])
    scales, biases = (
        mx.contiguous(a[..., start // group : (start + length) // group]) for a in (value.scales, value.biases)
    )
    return QuantizedArray(codes, scales, biases, value.bits, group, tuple(shape))


def _join(values: list[Tensor], axis: int) -> Tensor:
    if not isinstance(values[0], QuantizedArray):
        return mx.concatenate(values, axis=axis)
    first, shape = values[0], list(values[0].shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    arrays = (mx.concatenate([getattr(v, f) for v in values], axis=axis) for f in ("codes", "scales", "biases"))
    return QuantizedArray(*arrays, first.bits, first.group_size, tuple(shape))


def _stack(parts: list[Tensor], lead: tuple[int, ...]) -> Tensor:
    """Per-position parts stacked into the leading axes `lead`."""
    if not isinstance(parts[0], QuantizedArray):
        return mx.stack(parts).reshape(*lead, *parts[0].shape)
    first = parts[0]
    arrays = (
        mx.stack([getattr(p, f) for p in parts]).reshape(*lead, *getattr(first, f).shape)
        for f in ("codes", "scales", "biases")
    )
    return QuantizedArray(*arrays, first.bits, first.group_size, (*lead, *first.shape))
