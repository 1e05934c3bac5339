"""Structured output and forced tool calls through the server, enforced by llguidance on a random tiny model."""

from __future__ import annotations

import json

from tests.api.conftest import MODEL
from tests.structured.schemas import PERSON, TIME, WEATHER, validate

ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]


def _chat(server, **kwargs):
    kwargs.setdefault("messages", ASK)
    return server.openai().chat.completions.create(model=MODEL, **kwargs)


def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_output_validates_for_every_seed_and_copy(server):
    response = _chat(server, max_tokens=200, temperature=1.0, seed=5, n=4, response_format=_person_format())
    assert len(response.choices) == 4
    assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode_chat(ASK))  # counted once, not per copy
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        validate(json.loads(choice.message.content), PERSON)
    again = _chat(server, max_tokens=200, temperature=1.0, seed=5, n=4, response_format=_person_format())
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]


def test_json_schema_greedy_and_streamed_agree(server):
    whole = _chat(server, max_tokens=200, temperature=0, response_format=_person_format())
    validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(server, max_tokens=200, temperature=0, response_format=_person_format(), stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content


def test_json_object_parses_even_when_pushed_toward_closing_characters(server):
    tokenizer = server.engine.tokenizer
    bias = {str(tokenizer.token_to_id('"')): 8, str(tokenizer.token_to_id("}")): 8}
    response = _chat(
        server, max_tokens=300, temperature=1.0, seed=11, n=4, logit_bias=bias, response_format={"type": "json_object"}
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_invalid_schema_is_a_400_naming_response_format(server):
    http = server.http()
    body = {
        "model": MODEL,
        "messages": ASK,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}},
        },
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


def test_required_tool_call_follows_the_function_schema(server):
    response = _chat(
        server,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=3,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_calls_that_tool(server):
    response = _chat(
        server,
        max_tokens=120,
        temperature=1.0,
        seed=2,
        n=3,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [c.finish_reason for c in response.choices] == ["tool_calls"] * 3
    for choice in response.choices:
        [call] = choice.message.tool_calls  # one call, though parallel_tool_calls defaults to true
        assert call.function.name == "get_time"
    response = _chat(
        server,
        max_tokens=120,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_tools_whose_parameters_use_defs_can_be_forced(server):
    address = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    parameters = {  # as Pydantic writes a model with a nested model
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"address": {"$ref": "#/$defs/Address"}, "days": {"type": "integer", "maximum": 9}},
        "required": ["address", "days"],
    }
    tool = {"type": "function", "function": {"name": "plan", "parameters": parameters}}
    for choice in ("required", {"type": "function", "function": {"name": "plan"}}):
        response = _chat(server, max_tokens=60, temperature=1.0, seed=1, n=2, tools=[tool, TIME], tool_choice=choice)
        for c in response.choices:
            assert c.finish_reason == "tool_calls", c
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                if call.function.name == "plan":
                    assert arguments["address"]["city"] in ("Paris", "Rome") and arguments["days"] <= 9
                    assert set(arguments) == {"address", "days"}
    as_format = {"type": "json_schema", "json_schema": {"name": "plan", "schema": parameters}}
    answer = json.loads(
        _chat(server, max_tokens=60, temperature=0, response_format=as_format).choices[0].message.content
    )
    assert answer["address"]["city"] in ("Paris", "Rome")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(server):
    kwargs = dict(max_tokens=120, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    whole = _chat(server, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in _chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"
                    call["id"] = delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    [expected] = whole.message.tool_calls
    assert list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (expected.function.name, expected.function.arguments)
    assert calls[0]["id"].startswith("call_")
    assert [r for r in reasons if r] == ["tool_calls"]


def test_auto_renders_tools_into_the_prompt_and_none_leaves_them_out(server):
    with_tools = _chat(server, max_tokens=2, temperature=0, tools=[WEATHER])
    without = _chat(server, max_tokens=2, temperature=0, tools=[WEATHER], tool_choice="none")
    plain = _chat(server, max_tokens=2, temperature=0)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    rendered = server.engine.tokenizer.encode_chat(ASK, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens == len(rendered) > plain.usage.prompt_tokens


def test_forced_tool_call_cut_short_by_max_tokens_is_neither_a_call_nor_content(server):
    for stream in (False, True):
        kwargs = dict(max_tokens=20, temperature=0, tools=[WEATHER], tool_choice="required", stream=stream)
        if stream:
            chunks = [c.choices[0] for c in _chat(server, **kwargs) if c.choices]
            assert "".join(c.delta.content or "" for c in chunks) == ""
            assert not any(c.delta.tool_calls for c in chunks)
            assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
        else:
            choice = _chat(server, **kwargs).choices[0]
            assert choice.finish_reason == "length"
            assert choice.message.tool_calls is None
            assert choice.message.content is None
