"""The engine `base chat` talks to, which `/model NAME` replaces while the conversation goes on."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

from baselm.async_engine import AsyncEngine
from baselm.chat.settings import ChatSettings
from baselm.config import EngineConfig
from baselm.loader import LoadedModel, resolve
from baselm.sampling.defaults import GenerationDefaults, SamplingDefaults


@dataclass(frozen=True, slots=True)
class Opened:
    """A model's running engine and the chat settings its defaults give."""

    client: AsyncEngine
    settings: ChatSettings


class ModelSwitch:
    """Owns the chat's engine: `open` starts it on a loaded model, `switch` puts another model in
    its place, `close` stops it.

    A switch checks first that the name resolves (a typo leaves the chat as it was), then stops the
    running engine and lets its model go before loading the next one, so two models never share
    memory. When the next one fails to load, the one before is loaded again and the error raised.
    """

    def __init__(
        self,
        load: Callable[[str], LoadedModel],
        config: EngineConfig,
        sampling: SamplingDefaults,
        seed: int | None,
    ) -> None:
        self._load, self._config, self._sampling, self._seed = load, config, sampling, seed
        self._stack = contextlib.ExitStack()
        self.ref: str | None = None  # what the running model was asked by

    def open(self, loaded: LoadedModel, ref: str) -> Opened:
        """Starts the engine on `loaded` (asked for as `ref`)."""
        from baselm.chat.repl import open_chat_engine

        client = self._stack.enter_context(open_chat_engine(loaded, self._config))
        self.ref = ref
        engine = client.engine
        defaults = GenerationDefaults.for_model(self._sampling, loaded.config, engine.max_model_len)
        return Opened(client, ChatSettings.from_defaults(defaults.resolved(), self._seed))

    def switch(self, ref: str) -> Opened:
        """The engine on the model `ref`, in place of the running one."""
        resolve(ref)  # raises UnknownModelError / FileNotFoundError before anything stops
        previous = self.ref
        self.close()
        try:
            return self.open(self._load(ref), ref)
        except Exception:
            if previous is not None:
                self.open(self._load(previous), previous)
            raise

    def close(self) -> None:
        """Stops the running engine and frees its model's memory."""
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.ref = None
        gc.collect()  # the engine's arrays live in reference cycles; free them before the next load
        import mlx.core as mx

        mx.clear_cache()
