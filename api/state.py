"""What a route reads: the server's own state, shared by every model, and one served model's state.

`ServerState` is built once by `create_app` and sits on `app.state.base`: the API key, the body
limits, the metrics and the command line's sampling defaults; the model pool (pool.py) sits
beside it on `app.state.pool`. A
`ModelState` is one loaded model as the routes see it: its engine client, the name it answers to,
its template's tool-call format and reasoning, and the generation defaults of that model. A route
reads its body with the server's state, then asks the pool for the model the body names; for a
model that serves LoRA adapters (baselm/served_adapters.py) it gets the model as that request
asked for it (`for_request`): under an adapter's name, or with the adapters a `lora` list picks.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from baselm.adapters import AdapterError
from baselm.api.connections import DEFAULT_READ_TIMEOUT, BodyBudget
from baselm.api.errors import bad_request
from baselm.api.metrics import Metrics, ModelMetrics
from baselm.async_engine import AsyncEngine
from baselm.reasoning import template_thinks
from baselm.request import AdapterChoice
from baselm.sampling.defaults import NO_DEFAULTS, GenerationDefaults, SamplingDefaults
from baselm.served_adapters import ServedAdapter, ServedAdapters
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.markers import detect_format
from baselm.vision.image import ImageLimits

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(slots=True)
class ServerState:
    """What every model of the server shares; built once by `create_app`."""

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds for a request's body to arrive
    body_budget: BodyBudget = field(init=False)  # bytes of bodies read at once (see connections.py)
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # the command line's (serve --temperature, ...)
    image_limits: ImageLimits = ImageLimits()  # bytes, pixels and count of a request's images
    allow_image_urls: bool = False  # fetch http(s) image URLs (serve --allow-image-urls); else data URLs only

    def __post_init__(self) -> None:
        self.body_budget = BodyBudget(self.max_body_bytes)


@dataclass(slots=True)
class ModelState:
    """One loaded model as the routes see it: built by `ModelState.serving` when the model loads."""

    client: AsyncEngine
    model_name: str
    server: ServerState = field(default_factory=ServerState)
    tool_format: str = ""  # the call format the chat template teaches
    thinks: bool = False  # the chat template writes <think> blocks (a reasoning model)
    generation: GenerationDefaults = field(init=False)  # every default a request may leave out
    metrics: ModelMetrics = field(init=False)  # this model's series in /metrics
    adapter: ServedAdapter | None = None  # the LoRA adapter a request named as its model (`for_request`)
    adapters: AdapterChoice | None = None  # the LoRA adapters a request runs with; None: the plain model

    def __post_init__(self) -> None:
        engine = self.client.engine
        self.generation = GenerationDefaults.for_model(
            self.server.sampling_defaults, engine.loaded.config, engine.max_model_len
        )
        self.metrics = self.server.metrics.for_model(self.model_name)

    @classmethod
    def serving(cls, client: AsyncEngine, model_name: str, server: ServerState) -> ModelState:
        """The state of a started engine's model, its template read for tool calls and reasoning."""
        chat_template = client.engine.tokenizer.to_hf_files()[1].get("chat_template")
        return cls(client, model_name, server, detect_format(chat_template), template_thinks(chat_template))

    def fill_defaults(self, sampling: dict[str, Any], api: SamplingDefaults = NO_DEFAULTS) -> dict[str, Any]:
        """A body's SamplingParams keyword arguments with what it leaves out (None) filled in: the command
        line's, the model's, then `api`'s (the protocol's own), then llama.cpp's (sampling/defaults.py)."""
        return self.generation.fill(sampling, api)

    @property
    def served_adapters(self) -> ServedAdapters | None:
        """The LoRA adapters this model serves beside itself (base serve MODEL --lora), if any."""
        return self.client.engine.loaded.served_adapters

    def for_request(self, name: str) -> ModelState:
        """The model as a request naming it `name` gets it: an adapter's name runs that adapter and
        answers as `name`; its own name runs the default scales (none until POST /lora-adapters).
        NOTE: a copy per request of a model that serves adapters, sharing its client and series."""
        served = self.served_adapters
        if served is None:
            return self
        view = copy.copy(self)
        view.adapter = served.find(name) or served.find(name.removesuffix(":latest"))  # Ollama's tag, as pool.py
        if view.adapter is not None:
            view.model_name, view.adapters = view.adapter.name, served.named(view.adapter.name)
        else:
            view.adapters = served.defaults()
        return view

    def with_lora(self, lora: list[tuple[int, float]]) -> ModelState:
        """This request's state running exactly the adapters `lora` lists, by id (llama-server's
        field): each at its scale, every other at 0. A 400 naming `lora` for ids the model does not
        serve, or when the request named an adapter as its model already."""
        served = self.served_adapters
        if self.adapter is not None:
            raise bad_request(
                f"lora picks adapters for requests to the model they adapt; {self.model_name!r} is an adapter "
                "already: name the model it adapts, or leave lora out",
                "lora",
            )
        if served is None:
            if lora:
                raise bad_request(f"model {self.model_name!r} serves no LoRA adapters; leave lora out", "lora")
            return self
        try:
            choice = served.listed(lora)
        except AdapterError as exc:
            raise bad_request(str(exc), "lora") from None
        view = copy.copy(self)
        view.adapters = choice
        return view

    @property
    def tokenizer(self) -> Tokenizer:
        return self.client.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end an answer: the model's, else its tokenizer's."""
        return list(self.client.engine.eos_token_ids or self.tokenizer.eos_token_ids)
