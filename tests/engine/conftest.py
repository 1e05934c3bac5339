"""Engines over a tiny fixture model (tests/fixtures/models/llama) with the fixture BPE tokenizer."""

from __future__ import annotations

import pytest

from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from tests.tiny_model import loaded_fixture


@pytest.fixture
def make_engine():
    def make(name: str = "llama", **config) -> LLMEngine:
        config.setdefault("kv_memory", 2 * 2**20)
        return LLMEngine(loaded_fixture(name), EngineConfig(**config))

    return make
