"""SmolLM3's and gpt-oss's real chat templates (llama.cpp's copies) render as transformers renders them,
with their reasoning switches: SmolLM3's `enable_thinking` and `/think` `/no_think` system flags,
gpt-oss's harmony format with `reasoning_effort`, analysis-channel thinking, tool calls,
`builtin_tools` and `model_identity`. Expected texts: tests/tools/make_reasoning_template_fixtures.py."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import pytest

from baselm.store import hf
from baselm.tokenizer import chat_template
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER, FIXTURES

EXPECTED = json.loads((FIXTURES / "chat_templates" / "reasoning_flags.json").read_text(encoding="utf-8"))


class PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ARG003
        return datetime.fromisoformat(EXPECTED["now"])


@pytest.fixture
def template_of(llama_cpp_models: Path, monkeypatch: pytest.MonkeyPatch):
    """A template file's text as llama.cpp ships it (checked to be the one the texts were made from)."""
    monkeypatch.setattr(chat_template, "datetime", PinnedClock)

    def read(file: str) -> str:
        text = (llama_cpp_models / "templates" / file).read_text(encoding="utf-8")
        assert hashlib.sha256(text.encode()).hexdigest() == EXPECTED["sha256"][file]
        return text

    return read


@pytest.mark.parametrize("name", sorted(EXPECTED["cases"]))
def test_template_renders_as_transformers_does(name: str, template_of):
    case = EXPECTED["cases"][name]
    files = hf.read_tokenizer_files(BPE_TOKENIZER)
    tokenizer = Tokenizer.from_hf_files(
        files["tokenizer.json"], files["tokenizer_config.json"], template_of(case["template"])
    )
    text = tokenizer.apply_chat_template(
        case["messages"], case["add_generation_prompt"], case["tools"], **case["variables"]
    )
    assert text == case["text"]
