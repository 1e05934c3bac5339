"""Which bytes of a `.base` file one tensor-parallel rank reads.

The plan is made before any tensor is read: a skeleton of the model (its parameters are lazy and
never evaluated) gives the split layers, `Sharding.plan` the cut of each, and the model's own
`sanitize`, run over the file's tensor names alone, which file tensor each split layer loads.

NOTE: all or nothing. The file is read cut only when every split layer maps to exactly one file
tensor under a rename (`sanitize` may rename, but neither stack, split nor transpose: stacked
experts, fused qkv and gpt-oss experts do) and every cut falls inside its tensor and on its
quantization groups. Otherwise every tensor is read whole and sliced after loading, as GGUF files
and HF folders always are.
"""

from __future__ import annotations

from typing import Any

from baselm.models import model_class
from baselm.models.base import ModelConfigError
from baselm.store.base_reader import BaseFile
from baselm.store.base_slices import Cut, cut_fits


def plan_reads(base: BaseFile, sharding: Any) -> tuple[dict[str, Cut], dict[str, Cut]]:
    """(cut of each split layer by module path, the same cuts by file tensor name); both empty
    when the file must be read whole (see the module doc)."""
    config = base.header["config"]
    args_cls, model_cls = model_class(config.get("model_type", ""))
    model = model_cls(args_cls.from_dict(config))
    sources = checkpoint_names(model, list(base.tensors))
    group_sizes = {
        path: base.tensors[name].group_size for path, name in sources.items() if base.tensors[name].group_size
    }
    try:
        planned = sharding.plan(model, group_sizes)
    except ModelConfigError:  # a split off the groups: loading whole lets the hook say so, or split dense weights
        return {}, {}
    cuts = {sources[path]: cut for path, cut in planned.items() if path in sources}
    if len(cuts) != len(planned) or not all(cut_fits(base.tensors[name], cut) for name, cut in cuts.items()):
        return {}, {}
    return planned, cuts


def checkpoint_names(model: Any, names: list[str]) -> dict[str, str]:
    """Module path -> file tensor name for each `.weight` that `model.sanitize` only renames.

    `sanitize` runs over {name: name}: a value that comes out unchanged under a key is that
    tensor renamed. A sanitize that combines tensors fails on names or yields other values;
    those layers map to nothing."""
    try:
        renamed = model.sanitize({name: name for name in names})
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, ModelConfigError):
        return {}
    known = set(names)
    values = [v for v in renamed.values() if isinstance(v, str)]
    unique = {v for v in values if values.count(v) == 1}
    return {
        key.removesuffix(".weight"): value
        for key, value in renamed.items()
        if key.endswith(".weight") and isinstance(value, str) and value in known and value in unique
    }
