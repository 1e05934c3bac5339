"""Fixtures of the `base chat` tests: the fixture BPE tokenizer (ChatML) and a chat-ready tiny model folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER
from tests.tiny_model import write_model_folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The widened tiny llama (tests/tiny_model.py) with a 4096-token context and no
    end-of-sequence token, so every answer runs to max_tokens."""
    return write_model_folder(tmp_path_factory.mktemp("chat_model"), eos=False, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(BPE_TOKENIZER)
