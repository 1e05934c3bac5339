"""The server and the tool-call format its model's template teaches: refusals, and answers read with their markers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from baselm.api.chat import ChatRequest, sampling_params
from baselm.api.openai.chat import parse_chat
from baselm.sampling.defaults import NO_DEFAULTS, GenerationDefaults
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.markers import HARMONY, MISTRAL, needs_special_tokens
from baselm.toolcalls.parsers import HERMES
from tests.api.conftest import MODEL
from tests.paths import BPE_TOKENIZER

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def served_format(server):
    """Sets the shared server's tool-call format for one test, as if its model's template taught it."""
    state = server.server.config.app.state.pool.entries[server.model_name].state
    before = state.tool_format

    def set_format(fmt: str) -> None:
        state.tool_format = fmt

    yield set_format
    state.tool_format = before


def _chat(server, **kwargs):
    return server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **kwargs)


def test_tools_for_a_format_base_cannot_read_are_a_clear_400(server, served_format):
    served_format("solar_open")
    with pytest.raises(openai.BadRequestError, match="solar_open format .* does not parse yet") as caught:
        _chat(server, tools=[WEATHER])
    assert caught.value.body["param"] == "tools"
    assert _chat(server, tools=[WEATHER], tool_choice="none").choices[0].finish_reason == "length"
    assert _chat(server).choices[0].finish_reason == "length"  # no tools: nothing to parse


BOUNDED = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("fmt", [MISTRAL, "qwen3_xml", "deepseek", "granite_3", "glm", "gemma4", "lfm2", "hunyuan_3"])
def test_a_forced_call_in_another_format_comes_back_as_a_call(server, served_format, fmt):
    served_format(fmt)
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, tools=[BOUNDED], tool_choice="required", max_tokens=400, temperature=0
    )
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and not answer.choices[0].message.content
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
        assert isinstance(arguments["days"], int) and arguments["days"] <= 9
    named = [call.function.arguments for call in calls]
    assert calls and len(set(named)) == len(named)  # a repeated call ends the answer (RepeatStop)


def tokenizer_with_special(*tokens: str) -> Tokenizer:
    """The fixture BPE tokenizer with `tokens` added as special tokens."""
    backend = Backend.from_file(str(BPE_TOKENIZER / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    config = json.loads((BPE_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    return Tokenizer.from_hf_files(backend.to_str(), config)


def with_defaults(chat: ChatRequest) -> ChatRequest:
    """`chat` with what its body leaves out filled in, as `serving.read_request` fills it."""
    chat.common.sampling = GenerationDefaults(NO_DEFAULTS, NO_DEFAULTS, 2048).fill(chat.common.sampling)
    return chat


def test_answers_are_decoded_with_special_tokens_where_call_markers_are_special():
    tok = tokenizer_with_special("[TOOL_CALLS]", "[ARGS]")
    assert needs_special_tokens(MISTRAL, tok)
    assert not needs_special_tokens(HERMES, tok)  # <tool_call> is plain text in this vocabulary
    assert not needs_special_tokens(HARMONY, tok)
    mistral, hermes = (
        SimpleNamespace(tool_format=MISTRAL, tokenizer=tok),
        SimpleNamespace(tool_format=HERMES, tokenizer=tok),
    )
    chat = with_defaults(parse_chat({"model": MODEL, "messages": ASK, "tools": [WEATHER]}))
    assert sampling_params(mistral, chat).skip_special_tokens is False
    assert sampling_params(hermes, chat).skip_special_tokens is True
    without_tools = with_defaults(parse_chat({"model": MODEL, "messages": ASK}))
    assert sampling_params(mistral, without_tools).skip_special_tokens is True
