"""The models `base serve` serves, as the pool (pool.py) sees them: what may be served and how one
model is started and stopped.

`base serve` with no model serves every model in the store, read again when a request names one
not yet known (a pull, a copy since); `base serve A B` serves those alone (store names or paths).
A store model answers to its reference (`org/name:variant`) and to its shorter names when they
name it alone (`org/name`, `name`, `name:variant`). Each loaded model gets an engine of its own
with the command line's engine settings; with a prefix-cache file and several models, each model
keeps its own file beside it (`FILE.<model>`), since one file holds one model's blocks.
"""

from __future__ import annotations

import gc
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from baselm.api.pool import Servable
from baselm.api.state import ModelState, ServerState
from baselm.async_engine import AsyncEngine, EngineThreads
from baselm.config import EngineConfig


def store_servables(kv_memory: int | None = None) -> list[Servable]:
    """Every model in the store, with the short names that name it alone."""
    from baselm.store.registry import Store

    models = Store().list()
    short = Counter(alias.casefold() for m in models for alias in _short_names(m))
    return [
        Servable(
            m.ref,
            m.ref,
            _expected_size(m.size, kv_memory),
            tuple(a for a in _short_names(m) if short[a.casefold()] == 1),
        )
        for m in models
    ]


def _short_names(model) -> tuple[str, ...]:
    return tuple(dict.fromkeys((model.name, model.short_name, f"{model.short_name}:{model.variant}")))


def _expected_size(file_size: int, kv_memory: int | None) -> int:
    """A model's bytes before it is first loaded (then measured): its file, as the weights it holds,
    and its KV pool when --kv-memory sets it (else it is counted once loaded)."""
    return file_size + (kv_memory or 0)


def named_servables(refs: list[str], kv_memory: int | None = None) -> list[Servable]:
    """The models `base serve A B` names: store references (resolved now, so a typo fails at start)
    or paths (a `.base` or `.gguf` file, a model folder), named for their file."""
    from baselm.store.registry import Store

    store, found = Store(), []
    for ref in refs:
        path = Path(ref).expanduser()
        if path.exists():
            size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*"))
            found.append(
                Servable(path.stem if path.is_file() else path.name, str(path), _expected_size(size, kv_memory))
            )
            continue
        model = store.resolve(ref)
        aliases = tuple(a for a in (ref, *_short_names(model)) if a != model.ref)
        found.append(Servable(model.ref, model.ref, _expected_size(model.size, kv_memory), aliases))
    return found


@dataclass(slots=True)
class StoreLoader:
    """Starts and stops the pool's models with the command line's engine settings.

    `refs`: the models named on the command line; None serves the whole store."""

    config: EngineConfig
    device: str = "auto"
    require_signature: bool = False
    refs: list[str] | None = None
    num_models: int = 0  # how many the server may serve: a prefix-cache file is split past one
    # The engines' threads, reused from one load to the next (see EngineThreads).
    threads: EngineThreads = field(default_factory=EngineThreads)

    def catalog(self) -> list[Servable]:
        kv_memory = self.config.kv_memory
        return named_servables(self.refs, kv_memory) if self.refs is not None else store_servables(kv_memory)

    def add(self, ref: str) -> None:
        if self.refs is not None and ref not in self.refs:
            self.refs.append(ref)
            self.num_models = max(self.num_models, len(self.refs))

    def remove(self, ref: str) -> None:
        if self.refs is not None and ref in self.refs:
            self.refs.remove(ref)

    def load(self, servable: Servable, server: ServerState) -> ModelState:
        from baselm.backend import select_backend
        from baselm.engine import LLMEngine
        from baselm.loader import load_model

        loaded = load_model(servable.ref, select_backend(self.device), require_signature=self.require_signature)
        engine = LLMEngine(loaded, self._config_for(servable.name))
        return ModelState.serving(AsyncEngine(engine, self.threads).start(), servable.name, server)

    def _config_for(self, name: str) -> EngineConfig:
        if not self.config.prefix_cache_file or self.num_models == 1:
            return self.config
        return replace(self.config, prefix_cache_file=f"{self.config.prefix_cache_file}.{_file_part(name)}")

    def unload(self, state: ModelState) -> None:
        state.client.stop()  # saves its prefix cache

    def free(self) -> None:
        free_memory()


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def free_memory() -> None:
    """Gives an unloaded model's memory back, once its last reference is dropped: a collection (its
    engine may sit in reference cycles), then MLX's buffer cache and glibc's free heap pages
    returned (baselm/memory.py)."""
    from baselm.memory import release_freed_memory

    gc.collect()
    release_freed_memory()
