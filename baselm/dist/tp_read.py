"""Which bytes of a `.base` file one tensor-parallel rank reads.

The plan is made before any tensor is read: a skeleton of the model (its parameters are lazy and
never evaluated) gives the split layers, `Sharding.plan` the cut of each, and the model's own
`sanitize`, traced over tiny tags in place of the tensors, which file tensors each split layer
is made of: one renamed, or per-expert tensors stacked into a layer of experts (each expert's
tensor then takes the layer's cut).

NOTE: all or nothing. The file is read cut only when every split layer maps to its file tensors
that way (not: fused qkv split at load as phi3's, gpt-oss experts transposed at load) and every
cut falls inside its tensor and on its quantization groups. Otherwise every tensor is read whole
and sliced after loading, as GGUF files and HF folders always are.
Ranges are planned on the quantization groups also when the weights are widened to float after
loading (the CPU without kernels), where load-then-slice splits an MLP on any feature: an uneven
split (features not a multiple of ranks x group) may then differ from load-then-slice's, both valid.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx

from baselm.models import model_class
from baselm.models.base import ModelConfigError
from baselm.store.base_reader import BaseFile
from baselm.store.base_slices import Cut, cut_fits


def plan_reads(base: BaseFile, sharding: Any) -> tuple[dict[str, Cut], dict[str, Cut]]:
    """(cut of each split layer by module path, the same cuts by file tensor name); both empty
    when the file must be read whole (see the module doc)."""
    model = skeleton(base)
    sources = checkpoint_sources(model, list(base.tensors))
    group_sizes = {path: base.tensors[names[0]].group_size or 1 for path, names in sources.items()}
    try:
        planned = sharding.plan(model, group_sizes)
    except ModelConfigError:  # a split off the groups: loading whole lets the hook say so, or split dense weights
        return {}, {}
    planned = {path: cut for path, cut in planned.items() if cut.axis != 0}  # whole experts: see tp_moe.py
    if not planned or any(path not in sources for path in planned):
        return {}, {}
    cuts = {name: cut for path, cut in planned.items() for name in sources[path]}
    if not all(cut_fits(base.tensors[name], cut) for name, cut in cuts.items()):
        return {}, {}
    return planned, cuts


def skeleton(base: BaseFile) -> Any:
    """The model of `base`'s config with lazy parameters that are never evaluated (no memory)."""
    config = base.header["config"]
    args_cls, model_cls = model_class(config.get("model_type", ""))
    return model_cls(args_cls.from_dict(config))


def checkpoint_sources(model: Any, names: list[str]) -> dict[str, list[str]]:
    """Module path -> the file tensors its `.weight` is made of, for each layer that `sanitize`
    only renames, or stacks whole along a new leading axis (per-expert tensors into experts).

    `sanitize` runs over tags: file tensor i becomes the (1, 2) int32 array [[i, -1]]. A tag that
    comes out with the same trailing (1, 2) shape and values, under leading axes only, was renamed
    or stacked; one transposed, split, concatenated or computed on changes shape or values (or
    fails), and its layer maps to nothing. Tags are 8 bytes: no tensor is read to trace this."""
    tags = {name: mx.array([[i, -1]], dtype=mx.int32) for i, name in enumerate(names)}  # (1, 2)
    try:
        renamed = model.sanitize(tags)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RuntimeError, ModelConfigError):
        return {}
    sources: dict[str, list[str]] = {}
    for key, value in renamed.items():
        if not key.endswith(".weight") or not isinstance(value, mx.array) or value.dtype != mx.int32:
            continue
        if value.ndim < 2 or value.shape[-2:] != (1, 2):
            continue
        pairs = value.reshape(-1, 2).tolist()
        if all(tail == -1 and 0 <= i < len(names) for i, tail in pairs):
            sources[key.removesuffix(".weight")] = [names[i] for i, _ in pairs]
    uses = Counter(name for group in sources.values() for name in group)
    return {path: group for path, group in sources.items() if all(uses[name] == 1 for name in group)}
