"""Which rows and columns of which file tensors each weight of a model is made of.

The model's own `sanitize` (checkpoint tensors -> its parameters) runs over tags in place of the
tensors, once per traced axis. In the rows pass file tensor i becomes its row numbers, shape
(1, ..., rows, 1); in the columns pass its column numbers, (1, ..., 1, columns); each number
carries i in its high 32 bits. Renaming, stacking, splitting rows apart and transposing move the
numbers with the rows or columns they stand for, so a weight that comes out of a pass with one
trailing axis full (its size in the model) and the other as narrow as the tag says, for each of its rows (or
columns), the file tensor and the file row or column it is: phi3's q/k/v rows are row ranges of
`qkv_proj`, gpt-oss's expert rows are columns of its stacked, transposed file tensor. Tags are
small (one axis of each tensor): no tensor is read to trace this.

NOTE: a pass traces one axis. A weight's other trailing axis is taken to be its file tensor's
other axis, whole and in order, when their sizes agree: `sanitize` moves rows and columns whole
(a split, a stack, a transpose); it does not reorder the values inside a row or compute on them.
A weight whose numbers are not all from one file tensor per leading position (gate and up rows
interleaved from two tensors), or change dtype, or whose pass raises, is not traced.
Where `sanitize` splits the untraced axis in two (fused gate and up experts in the columns
pass), the pass runs again with that axis 2 wide, and a weight's numbers are read from its first
row or column.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from baselm.models.base import ModelConfigError
from baselm.store.base_header import TensorEntry

TAG_SHIFT = 32  # a tag is tensor_index << TAG_SHIFT | row or column
SANITIZE_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError, RuntimeError, ModelConfigError)


@dataclass(frozen=True, slots=True)
class AxisSource:
    """Where one trailing axis of a weight comes from: per leading position of the weight (one
    position when the file tensor has the leading axes itself), a file tensor and, for each row
    (or column) of the weight along that axis, its index along `file_axis` of that tensor."""

    names: tuple[str, ...]  # file tensor of each leading position
    file_axis: int  # -2 (rows) or -1 (columns) of the file tensors
    indices: np.ndarray  # (len(names), size of the weight's axis) int64
    lead: tuple[int, ...]  # leading axes the positions are stacked into; () when the file has them


@dataclass(slots=True)
class Trace:
    """What a `sanitize` trace found: (module path, weight axis) -> source, and each file tensor's
    uses (the parameter names its numbers reach, in any pass)."""

    sources: dict[tuple[str, int], AxisSource] = field(default_factory=dict)
    uses: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def feeds(self) -> dict[str, list[str]]:
        """Module path -> the file tensors whose numbers reach its `.weight`."""
        feeds: dict[str, list[str]] = defaultdict(list)
        for name, keys in self.uses.items():
            for key in keys:
                if key.endswith(".weight"):
                    feeds[key.removesuffix(".weight")].append(name)
        return feeds


def trace_sources(model: nn.Module, entries: dict[str, TensorEntry]) -> Trace:
    """Traces `model.sanitize` over the file tensors `entries` (see the module doc)."""
    names, shapes = list(entries), skeleton_shapes(model)
    trace = Trace()
    for file_axis in (-2, -1):
        out, width = _traced_pass(model, entries, file_axis)
        for key, value in (out or {}).items():
            ids = np.unique(value >> TAG_SHIFT) if value.size else []
            for i in ids:
                if 0 <= i < len(names):
                    trace.uses[names[i]].add(key)
            if key.endswith(".weight") and key in shapes and value.ndim >= 2:
                path = key.removesuffix(".weight")
                for axis in (-2, -1):
                    source = _resolve(value, shapes[key], (axis, file_axis, width), names, entries)
                    if source is not None:
                        trace.sources[(path, axis)] = source
    return trace


def sanitized(model: nn.Module, tags: dict[str, mx.array]) -> dict[str, np.ndarray] | None:
    """`model.sanitize(tags)`, its int64 outputs as numpy; None when it raises. Tags are tiny: the
    CPU traces them whatever the device."""
    with mx.stream(mx.cpu):
        try:
            out = model.sanitize(dict(tags))
        except SANITIZE_ERRORS:
            return None
        return {k: np.array(v) for k, v in out.items() if isinstance(v, mx.array) and v.dtype == mx.int64}


def _traced_pass(
    model: nn.Module, entries: dict[str, TensorEntry], file_axis: int
) -> tuple[dict[str, np.ndarray] | None, int]:
    """(`sanitize`'s outputs, width of the untraced trailing axis) of the pass over `file_axis`.
    The untraced axis is 1 wide, or 2 when `sanitize` raises on that (fused gate and up experts
    split in two along it); None when it raises on both."""
    for width in (1, 2):
        out = sanitized(
            model, {name: _tag(i, e.shape, file_axis, width) for i, (name, e) in enumerate(entries.items())}
        )
        if out is not None:
            return out, width
    return None, 1


def _tag(index: int, shape: tuple[int, ...], file_axis: int, width: int = 1) -> mx.array:
    """File tensor `index`'s tag for the pass over `file_axis` (a vector's only axis in both), its
    other trailing axis `width` wide (the numbers repeated)."""
    if not shape:
        return mx.array(index << TAG_SHIFT, dtype=mx.int64)
    axis = file_axis if len(shape) >= 2 else -1
    tag_shape = [1] * len(shape)
    tag_shape[axis] = shape[axis]
    tag = (mx.arange(shape[axis], dtype=mx.int64) + (index << TAG_SHIFT)).reshape(tag_shape)
    if len(shape) < 2:
        return tag
    tag_shape[-3 - axis] = min(width, shape[-3 - axis])
    return mx.broadcast_to(tag, tag_shape)


def _resolve(
    value: np.ndarray,
    shape: tuple[int, ...],
    axes: tuple[int, int, int],
    names: list[str],
    entries: dict[str, TensorEntry],
) -> AxisSource | None:
    """The source of trailing `axis` of a weight of `shape` that came out of the pass over
    `file_axis` as `value` (`axes`: axis, file_axis, width of the untraced axis), or None when
    that pass does not trace it (see the module doc)."""
    axis, file_axis, width = axes
    other, other_file = -3 - axis, -3 - file_axis  # the other trailing axis (-2 <-> -1)
    lead, value_lead = shape[:-2], value.shape[:-2]
    if value.ndim != len(shape) or value.shape[axis] != shape[axis] or value.shape[other] not in (1, width):
        return None
    stacked = value_lead == lead and bool(lead)
    if not stacked and any(n != 1 for n in value_lead):
        return None
    lines = np.take(value, 0, axis=other).reshape(-1, shape[axis])  # (positions, size)
    ids, indices = lines >> TAG_SHIFT, lines & ((1 << TAG_SHIFT) - 1)
    if (ids != ids[:, :1]).any() or not ((ids[:, 0] >= 0) & (ids[:, 0] < len(names))).all():
        return None  # a position made of several tensors, or numbers that are not tags
    chosen = tuple(names[i] for i in ids[:, 0])
    for name, line in zip(chosen, indices):
        file_shape = entries[name].shape
        if len(file_shape) < 2 or file_shape[other_file] != shape[other] or line.max() >= file_shape[file_axis]:
            return None
        if (len(file_shape) != 2) if stacked else (tuple(file_shape[:-2]) != lead):
            return None
    return AxisSource(chosen, file_axis, indices, lead if stacked else ())


def passes_through(model: nn.Module, kept: dict[str, TensorEntry], keys: dict[str, tuple[int, ...]]) -> bool:
    """Whether `sanitize`, given the file tensors `kept` and weights already named as the model
    names them (`keys`: name -> shape), hands those weights on unchanged: then weights put
    together outside `sanitize` can go in beside the file's other tensors."""
    names = list(kept)
    given = {key: _tag(len(names) + i, shape, -2) for i, (key, shape) in enumerate(keys.items())}
    for width in (1, 2):  # as `_traced_pass`
        out = sanitized(model, {name: _tag(i, kept[name].shape, -2, width) for i, name in enumerate(names)} | given)
        if out is not None:
            return all(key in out and np.array_equal(out[key], np.array(tag)) for key, tag in given.items())
    return False


def skeleton_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape (the skeleton's parameters are never evaluated)."""
    return {key: tuple(value.shape) for key, value in nn.utils.tree_flatten(model.parameters())}
