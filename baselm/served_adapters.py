"""The LoRA adapters a served model runs per request (`base serve MODEL --lora NAME=PATH[:scale]`).

One `ServedAdapters` per loaded model owns them: each adapter has an id (its slot, in the order
given), a name, its file(s) and the scale a request naming it gets. Attached once to the model's
projections (baselm/models/lora.py), they run beside plain requests in the same batches over one
set of base weights; the merged kind (`--adapter`, baselm/adapters.py) changes the weights for all.

What a request runs with (`AdapterChoice`, which the request carries to the runner):
- its model is an adapter's NAME: that adapter at its scale (vLLM's `--lora-modules` way);
- it lists `lora: [{"id", "scale"}]` (llama-server's field): exactly those, every other at 0;
- otherwise: the default scales, all 0 (the plain model) until `POST /lora-adapters` sets them
  (llama-server's global scales).

An adapter's K/V identity (`AdapterChoice.cache_key`, in the block hashes) is its files'
fingerprint with the scale: one file under two names shares K/V, an edited file does not, also
across restarts with a prefix cache file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.adapters import Adapter, AdapterError, factors, read_adapter, split_scale
from baselm.kv.persist import weights_fingerprint
from baselm.models import lora
from baselm.models.base import ModelConfigError
from baselm.models.linear import linear_shape
from baselm.request import AdapterChoice


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One `--lora NAME=PATH[:scale]`: the name requests use, the adapter as read (at scale 1), its scale."""

    name: str
    adapter: Adapter
    scale: float

    @classmethod
    def read(cls, spec: str) -> AdapterSpec:
        """Reads `NAME=PATH[:scale]`: an mlx-lm or PEFT folder or a GGUF LoRA (baselm/adapters.py)."""
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or not name or not rest or any(c.isspace() for c in name):
            raise AdapterError(f"--lora {spec!r}: give NAME=PATH[:scale], a name without spaces")
        path, scale = split_scale(rest)
        return cls(name, read_adapter(path), scale)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """One adapter a model serves: `id` is its slot."""

    id: int
    name: str
    path: Path
    scale: float  # what a request naming it gets
    fingerprint: str  # of its file(s): what its K/V are keyed by
    nbytes: int  # what its factors hold in memory, beside the model's weights


class ServedAdapters:
    """The adapters of one served model, by id; the one place that turns a request's ask into an
    `AdapterChoice` and that holds the default scales."""

    def __init__(self, adapters: Sequence[ServedAdapter]) -> None:
        self.adapters = list(adapters)
        self.default_scales = [0.0] * len(self.adapters)  # what other requests get (POST /lora-adapters)

    @classmethod
    def attach(cls, model: nn.Module, specs: Sequence[AdapterSpec], config: dict[str, Any]) -> ServedAdapters:
        """Gives each adapter of `specs` a slot in `model`'s projections (`config`, the model's, puts a
        GGUF adapter's q/k rows back in HF order); an adapter that does not fit is an AdapterError."""
        names = [spec.name for spec in specs]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise AdapterError(f"--lora names {twice!r} twice; give each adapter its own name")
        served = []
        for slot, spec in enumerate(specs):
            factors = _attach_one(model, slot, spec.adapter, config)
            mx.eval(factors)
            path, nbytes = spec.adapter.path, sum(f.nbytes for f in factors)
            served.append(ServedAdapter(slot, spec.name, path, spec.scale, weights_fingerprint(path), nbytes))
        return cls(served)

    def __len__(self) -> int:
        return len(self.adapters)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def find(self, name: str) -> ServedAdapter | None:
        return next((a for a in self.adapters if a.name == name), None)

    def named(self, name: str) -> AdapterChoice:
        """What a request whose model is the adapter `name` runs with."""
        adapter = self.find(name)
        if adapter is None:
            raise AdapterError(f"no adapter is named {name!r}; this model serves {self._listing()}")
        return self._choice({adapter.id: adapter.scale})

    def listed(self, scales: Sequence[tuple[int, float]]) -> AdapterChoice | None:
        """What a request listing `(id, scale)` pairs runs with (llama-server's `lora`): those, others at 0."""
        return self._choice(self._by_id(scales))

    def defaults(self) -> AdapterChoice | None:
        """What a request that names no adapter runs with: the default scales (None: the plain model)."""
        return self._choice(dict(enumerate(self.default_scales)))

    def set_default_scales(self, scales: Sequence[tuple[int, float]]) -> None:
        """llama-server's global scales: those listed, every other at 0."""
        by_id = self._by_id(scales)
        self.default_scales = [by_id.get(i, 0.0) for i in range(len(self.adapters))]

    def describe(self) -> list[dict[str, Any]]:
        """GET /lora-adapters: id, path and default scale of each, as llama-server lists them, and the name."""
        return [
            {"id": a.id, "name": a.name, "path": str(a.path), "scale": self.default_scales[a.id]} for a in self.adapters
        ]

    def check(self, ids: Iterable[int]) -> None:
        """Raises AdapterError unless every one of `ids` is one of these adapters'."""
        bad = next((i for i in ids if not 0 <= i < len(self.adapters)), None)
        if bad is not None:
            raise AdapterError(f"adapter id {bad} is not one of this model's; it serves {self._listing()}")

    def _by_id(self, scales: Sequence[tuple[int, float]]) -> dict[int, float]:
        by_id = dict(scales)
        self.check(by_id)
        return by_id

    def _choice(self, scales: dict[int, float]) -> AdapterChoice | None:
        slots = tuple((slot, float(scale)) for slot, scale in sorted(scales.items()) if scale != 0.0)
        if not slots:
            return None
        key = "lora:" + ";".join(f"{self.adapters[s].fingerprint}*{scale!r}" for s, scale in slots)
        return AdapterChoice(slots, key)

    def _listing(self) -> str:
        listed = ", ".join(f"{a.id} ({a.name})" for a in self.adapters)
        return f"adapters {listed}" if listed else "no adapters"


def _attach_one(model: nn.Module, slot: int, adapter: Adapter, config: dict[str, Any]) -> list[mx.array]:
    """Attaches `adapter`'s factors to the projections it adapts; returns them (to be evaluated)."""
    attached = []
    for module, change in adapter.deltas.items():
        try:
            linear = lora.projection(model, module)
        except ModelConfigError as exc:
            raise AdapterError(f"{adapter.path}: {exc}") from None
        up, down = factors(change, config)  # (out, r), (r, in)
        if linear_shape(linear) != (up.shape[0], down.shape[1]):
            raise AdapterError(
                f"{adapter.path}: {module} is {linear_shape(linear)}, its delta {(up.shape[0], down.shape[1])}"
            )
        a, b = mx.contiguous(down.T), up.T * change.factor  # (in, r), (r, out)
        lora.attach(linear, slot, a, b)
        attached += [a, b]
    return attached
