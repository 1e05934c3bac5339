"""Engines over a tiny fixture model (tests/fixtures/models/llama) with the fixture BPE tokenizer."""

from __future__ import annotations

import functools

import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.models import build_model
from baselm.store import hf
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES


@functools.cache
def tiny_loaded(name: str = "llama") -> LoadedModel:
    folder = MODEL_FIXTURES / name
    config = hf.read_config(folder)
    config["max_position_embeddings"] = 512
    model = build_model(config, hf.read_weights(folder))
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    return LoadedModel(name, folder, model, tokenizer, config, (), select_backend("cpu"))


@pytest.fixture
def make_engine():
    def make(name: str = "llama", **config) -> LLMEngine:
        config.setdefault("kv_memory", 2 * 2**20)
        return LLMEngine(tiny_loaded(name), EngineConfig(**config))

    return make
