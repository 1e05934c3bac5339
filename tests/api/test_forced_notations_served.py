"""Forced tool calls over HTTP, with the real `openai` client, in the formats whose arguments are not
JSON: Gemma 4's notation, LFM2's Python calls and Hunyuan 3's `:opensource` XML.

Each model is a tiny random Qwen2 with Qwen2.5's real vocabulary, the format's markers added as
control tokens (as the real vocabularies hold them), and the real chat template of a model that
writes that format (llama.cpp's copies), from which the server tells the format. The random model
writes nothing sensible on its own, so every call that comes back is the grammar's doing.
"""

from __future__ import annotations

import json

import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from baselm.toolcalls.markers import MARKERS
from tests.api.conftest import RunningServer
from tests.structured.schemas import validate
from tests.toolcalls.qwen_vocab import qwen25_tool_gguf

TEMPLATES = {
    "gemma4": "google-gemma-4-31B-it.jinja",
    "lfm2": "LFM2.5-8B-A1B.jinja",
    "hunyuan_3": "tencent-Hy3.jinja",
}
FIRST_TOKEN = {"gemma4": "<|tool_call>", "lfm2": "<|tool_call_start|>", "hunyuan_3": "<tool_calls:opensource>"}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_room",
        "description": "Book a hotel room.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 6},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "breakfast": {"type": "boolean"},
                "guests": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}}},
                    "maxItems": 2,
                },
            },
            "required": ["city", "nights", "breakfast"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
TOOLS = {"book_room": BOOK, "get_time": TIME}
ASK = [{"role": "user", "content": "Book me a room in Rome for two nights."}]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, tmp_path_factory, llama_cpp_models):
    fmt = request.param
    path = tmp_path_factory.mktemp(fmt) / f"tiny-{fmt}.gguf"
    qwen25_tool_gguf(path, llama_cpp_models, TEMPLATES[fmt], MARKERS[fmt])
    running = RunningServer(loaded=load_model(str(path), select_backend("cpu")), model_name=fmt)
    yield fmt, running
    running.stop()


def _create(fmt, server, **kwargs):
    return server.openai().chat.completions.create(
        model=fmt, messages=ASK, tools=[BOOK, TIME], temperature=0, max_tokens=600, **kwargs
    )


def _check(calls) -> list[tuple[str, dict]]:
    """Each call valid for its tool, none twice; returns (name, arguments) of each."""
    read = [(call.function.name, json.loads(call.function.arguments)) for call in calls]
    for name, arguments in read:
        validate(arguments, TOOLS[name]["function"]["parameters"])
    assert read and len({json.dumps(c, sort_keys=True) for c in read}) == len(read)
    return read


def test_the_server_reads_the_format_from_the_real_template(served):
    fmt, server = served
    assert server.server.config.app.state.pool.entries[fmt].state.tool_format == fmt


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_call_comes_back_whole_and_valid(served, parallel):
    fmt, server = served
    answer = _create(fmt, server, tool_choice="required", parallel_tool_calls=parallel).choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert answer.message.content in (None, "")
    calls = _check(answer.message.tool_calls)
    assert parallel or len(calls) == 1


def test_a_named_tool_is_the_one_called(served):
    fmt, server = served
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = _create(fmt, server, tool_choice=choice).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content in (None, "")
    assert [name for name, _ in _check(answer.message.tool_calls)] == ["get_time"]


def test_a_forced_call_streams_the_same_calls(served):
    fmt, server = served
    whole = _create(fmt, server, tool_choice="required").choices[0].message.tool_calls
    chunks = list(_create(fmt, server, tool_choice="required", stream=True))
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, arguments = streamed.setdefault(delta.index, ["", ""])
            streamed[delta.index] = [name + (delta.function.name or ""), arguments + (delta.function.arguments or "")]
    assert [(n, json.loads(a)) for n, a in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


def test_the_answer_opens_with_the_format_marker_token(served):
    """The grammar asks for the markers as the control tokens the model writes, not spelled in pieces."""
    fmt, server = served
    body = {"model": fmt, "messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": 300}
    body |= {"temperature": 0, "logprobs": True, "top_logprobs": 1, "parallel_tool_calls": False}
    answer = server.http().post("/v1/chat/completions", json=body).json()
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == FIRST_TOKEN[fmt], tokens
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
