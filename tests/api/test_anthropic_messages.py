"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client against a real server.

Messages runs the chat completions path, so a greedy message must be exactly the chat answer
to the same conversation; most tests check that correspondence. The anthropic client no
longer has sampling arguments, so temperature goes in `extra_body`."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.api.conftest import MODEL
from tests.api.test_errors import assert_serving
from tests.structured.schemas import PERSON, TIME, WEATHER, validate

HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
TIME_TOOL = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}


def _client(server, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=60)


def _create(server, **kwargs):
    kwargs.setdefault("messages", HELLO)
    kwargs.setdefault("extra_body", GREEDY)
    return _client(server).messages.create(model=MODEL, **kwargs)


def _chat(server, messages, **kwargs):
    return server.openai().chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_message_is_the_chat_answer_to_the_same_conversation(server):
    message = _create(server, max_tokens=10, system=[{"type": "text", "text": "Be brief."}])
    chat = _chat(server, [{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=10)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == 10


def test_multi_turn_content_blocks(server):
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "And again"},
    ]
    message = _create(server, max_tokens=6, messages=turns, system="Be brief.")
    chat_turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "And again"},
    ]
    chat = _chat(server, chat_turns, max_tokens=6)
    assert message.content[0].text == chat.choices[0].message.content


def test_stream_events_reassemble_to_the_whole_message(server):
    whole = _create(server, max_tokens=12)
    with _client(server).messages.stream(model=MODEL, messages=HELLO, max_tokens=12, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in deltas)
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_ping_follows_message_start_on_the_wire(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True}
    with server.http().stream("POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        names = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_forced_tool_use_and_the_result_round_trip(server):
    message = _create(
        server,
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    validate(use.input, WEATHER["function"]["parameters"])
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    answer = _create(server, max_tokens=6, messages=turns, tools=[WEATHER_TOOL, TIME_TOOL])
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny"},
    ]
    chat = _chat(server, history, max_tokens=6, tools=[WEATHER, TIME])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == (chat.choices[0].message.content or "")


def test_any_tool_choice_streams_input_json(server):
    kwargs = dict(
        max_tokens=120, messages=[{"role": "user", "content": "Time?"}], tools=[TIME_TOOL], tool_choice={"type": "any"}
    )
    whole = _create(server, **kwargs)
    with _client(server).messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input == final.content[0].input
    assert final.stop_reason == "tool_use"


def test_none_tool_choice_leaves_tools_out(server):
    with_none = _create(server, max_tokens=2, tools=[WEATHER_TOOL], tool_choice={"type": "none"})
    plain = _create(server, max_tokens=2)
    assert (
        with_none.usage.input_tokens + with_none.usage.cache_read_input_tokens
        == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )


def test_stop_sequences_end_with_stop_sequence(server):
    whole = _create(server, max_tokens=12)
    text = whole.content[0].text
    stop = text[3:5]
    assert stop.strip(), text  # the fixture model's greedy answer has text to stop on
    message = _create(server, max_tokens=12, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_output_config_json_schema(server):
    fmt = {"type": "json_schema", "schema": PERSON}
    message = _create(server, max_tokens=200, extra_body={"temperature": 0.8, "output_config": {"format": fmt}})
    validate(json.loads(message.content[0].text), PERSON)


def test_count_tokens_is_the_prompt_length(server):
    counted = _client(server).messages.count_tokens(
        model=MODEL, messages=HELLO, system="Be brief.", tools=[WEATHER_TOOL]
    )
    expected = server.engine.tokenizer.encode_chat(
        [{"role": "system", "content": "Be brief."}, *HELLO], tools=[WEATHER]
    )
    assert counted.input_tokens == len(expected)


def _assert_anthropic_error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


def test_errors_have_anthropic_shape(server):
    http = server.http()
    message = _assert_anthropic_error(
        http.post("/v1/messages", json={"model": MODEL, "messages": HELLO}), 400, "invalid_request_error"
    )
    assert "max_tokens" in message
    _assert_anthropic_error(
        http.post("/v1/messages", json={"model": "nope", "messages": HELLO, "max_tokens": 1}), 404, "not_found_error"
    )
    _assert_anthropic_error(
        http.post("/v1/messages", json={"model": MODEL, "messages": HELLO, "max_tokens": 1, "temperature": 1.5}),
        400,
        "invalid_request_error",
    )
    image = [
        {
            "role": "user",
            "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}],
        }
    ]
    message = _assert_anthropic_error(
        http.post("/v1/messages", json={"model": MODEL, "messages": image, "max_tokens": 1}),
        400,
        "invalid_request_error",
    )
    assert "messages[0].content[0]" in message
    with pytest.raises(anthropic.BadRequestError) as caught:
        _create(server, max_tokens=0)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert_serving(server)


def test_x_api_key_and_bearer_both_authorize(make_server_with):
    served = make_server_with(api_key="secret")
    http = served.http()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    assert http.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code == 200
    assert http.post("/v1/messages", json=body, headers={"authorization": "Bearer secret"}).status_code == 200
    _assert_anthropic_error(
        http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}), 401, "authentication_error"
    )
    _assert_anthropic_error(http.post("/v1/messages", json=body), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        _client(served, api_key="wrong").messages.create(model=MODEL, messages=HELLO, max_tokens=1)
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": "secret"}).status_code == 200
    assert (
        _client(served, api_key="secret").messages.create(model=MODEL, messages=HELLO, max_tokens=1).usage.output_tokens
        == 1
    )


def test_unknown_methods_on_messages_routes_have_anthropic_shape(server):
    http = server.http()
    _assert_anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    _assert_anthropic_error(http.post("/v1/messages/nothing", json={}), 404, "not_found_error")
    assert set(http.get("/v1/chat/completions").json()["error"]) == {"message", "type", "param", "code"}


def test_disable_parallel_tool_use_makes_one_call(server):
    tools = [WEATHER_TOOL, TIME_TOOL]
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = _create(
        server,
        max_tokens=200,
        messages=[{"role": "user", "content": "Go"}],
        tools=tools,
        tool_choice=choice,
        extra_body={"temperature": 1.0},
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["tool_use"]
