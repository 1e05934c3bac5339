"""Forced tool calls on a model with Qwen2.5's real vocabulary and template, served over HTTP.

`<tool_call>` and `</tool_call>` are single added tokens there, as in every Qwen2.5 file people
download. A grammar that spelled them as text let the model write the `<tool_call>` token (the
tokenizer encodes the grammar's text into it) that llguidance's byte matcher then refused, and the
answer ended at once: 200, no call, empty content. The random model here writes nothing on its
own, so every call that comes back is the grammar's doing, token by token.
"""

from __future__ import annotations

import json

import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from tests.api.conftest import RunningServer
from tests.structured.schemas import TIME
from tests.toolcalls.qwen_vocab import TOOL_CALL, TOOL_CALL_END, qwen25_tool_gguf

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        # bounded, so that the random model's string ends within max_tokens
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, llama_cpp_models):
    path = qwen25_tool_gguf(tmp_path_factory.mktemp("qwen") / "qwen25-tools.gguf", llama_cpp_models)
    running = RunningServer(loaded=load_model(str(path), select_backend("cpu")), model_name="qwen")
    yield running
    running.stop()


def _create(server, **kwargs):
    return server.openai().chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=200, **kwargs
    )


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_comes_back_whole_and_parses(qwen_server, choice):
    answer = _create(qwen_server, tool_choice=choice).choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert answer.message.content in (None, "")
    (call, *_) = answer.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
        assert set(json.loads(call.function.arguments)) <= {"zone"}
    else:
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        assert call.function.name != "get_weather" or isinstance(arguments["city"], str)


def test_a_forced_call_streams_the_same_call(qwen_server):
    whole = _create(qwen_server, tool_choice="required").choices[0].message.tool_calls
    chunks = list(_create(qwen_server, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    name = "".join(d.tool_calls[0].function.name or "" for d in deltas)
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert (name, json.loads(arguments)) == (whole[0].function.name, json.loads(whole[0].function.arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls" or chunks[-2].choices[0].finish_reason == "tool_calls"


def test_the_grammar_asks_for_the_call_tokens_the_model_writes(qwen_server):
    """The answer's ids open with the `<tool_call>` token itself, not its text spelled in pieces."""
    body = {"model": "qwen", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}
    body |= {"temperature": 0, "logprobs": True, "top_logprobs": 1}
    answer = qwen_server.http().post("/v1/chat/completions", json=body).json()
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == "<tool_call>" and tokens[tokens.index("</tool_call>")] == "</tool_call>"
    tokenizer = qwen_server.engine.tokenizer
    assert tokenizer.encode("<tool_call></tool_call>", add_special_tokens=False) == [TOOL_CALL, TOOL_CALL_END]
