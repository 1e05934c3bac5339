"""The chat templates real models ship (llama.cpp's collection) render as transformers renders them,
their prompts keep the ids of the rendered text, and a user's text spelling control tokens stays text.

tests/fixtures/chat_templates/expected.json (made by tests/tools/make_chat_template_fixtures.py)
holds, for each template file and conversation, transformers' `apply_chat_template` text, or
the error where transformers refuses it. The templates themselves are read from llama-cpp-python's
sdist (tests/llama_cpp_files.py); each must still have the sha256 the texts were made from.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

import pytest

from baselm.tokenizer import chat_template
from baselm.tokenizer.errors import ChatTemplateError
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER, FIXTURES
from tests.tokenizer.conftest import FORGED, encoded_whole

EXPECTED = json.loads((FIXTURES / "chat_templates" / "expected.json").read_text(encoding="utf-8"))
CASES = [(name, scenario) for name, entry in EXPECTED["templates"].items() for scenario in entry["scenarios"]]


def _want(name: str, scenario: str) -> dict:
    return EXPECTED["templates"][name]["scenarios"][scenario]


class _PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None) -> datetime:
        return datetime.fromisoformat(EXPECTED["now"])


@pytest.fixture
def pinned_clock(monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", _PinnedClock)


def with_template(template: str) -> Tokenizer:
    """The `bpe` fixture tokenizer (the one the expected texts were made with) with `template`."""
    config = json.loads((BPE_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_json = (BPE_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8")
    return Tokenizer.from_hf_files(tokenizer_json, config, chat_template=template)


def read_template(models, name: str) -> str:
    template = (models / "templates" / name).read_text(encoding="utf-8")
    sha = hashlib.sha256(template.encode()).hexdigest()
    assert sha == EXPECTED["templates"][name]["sha256"], f"{name} changed: rerun make_chat_template_fixtures.py"
    return template


@pytest.mark.parametrize(("name", "scenario"), CASES)
def test_real_template_renders_as_transformers_does(llama_cpp_models, pinned_clock, name, scenario):
    tok = with_template(read_template(llama_cpp_models, name))
    case = EXPECTED["scenarios"][scenario]
    want = EXPECTED["templates"][name]["scenarios"][scenario]

    def render() -> str:
        return tok.apply_chat_template(case["messages"], case["add_generation_prompt"], case.get("tools"))

    if "error" in want:
        with pytest.raises(ChatTemplateError):
            render()
    else:
        assert render() == want["text"]


def test_every_shipped_template_has_expected_texts(llama_cpp_models):
    shipped = {p.name for p in (llama_cpp_models / "templates").glob("*.jinja")}
    assert shipped == set(EXPECTED["templates"])


@pytest.mark.parametrize(("name", "scenario"), [c for c in CASES if "error" not in _want(*c)])
def test_real_template_prompt_ids_are_the_rendered_text_encoded_whole(llama_cpp_models, pinned_clock, name, scenario):
    tok = with_template(read_template(llama_cpp_models, name))
    case = EXPECTED["scenarios"][scenario]
    ids = tok.encode_chat(case["messages"], case["add_generation_prompt"], case.get("tools"))
    assert ids == encoded_whole(tok, case["messages"], case["add_generation_prompt"], case.get("tools"))


@pytest.mark.parametrize("name", list(EXPECTED["templates"]))
def test_real_template_keeps_control_tokens_a_user_spells_as_text(llama_cpp_models, pinned_clock, name):
    tok = with_template(read_template(llama_cpp_models, name))
    try:
        benign = tok.encode_chat([{"role": "user", "content": "x"}])
    except ChatTemplateError:
        pytest.skip(f"{name} refuses a lone user message")
    ids = tok.encode_chat([{"role": "user", "content": FORGED}])
    assert [i for i in ids if i in tok.special_token_ids] == [i for i in benign if i in tok.special_token_ids]
