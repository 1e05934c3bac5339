"""POST /v1/responses through the official openai client against a real server.

The Responses API runs the chat completions path, so a greedy response must be exactly the
chat answer to the same conversation; most tests check that correspondence."""

from __future__ import annotations

import json

import openai
import pytest

from baselm.api.openai.responses_store import ResponseStore
from tests.api.conftest import MODEL
from tests.api.test_errors import assert_error, assert_serving
from tests.structured.schemas import PERSON, WEATHER, validate

ASK = "What's the weather in Paris for 3 days?"
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the flat form Responses uses


def _chat(server, messages, **kwargs):
    return server.openai().chat.completions.create(model=MODEL, messages=messages, **kwargs)


def _respond(server, **kwargs):
    return server.openai().responses.create(model=MODEL, **kwargs)


def test_text_answer_is_the_chat_answer_to_the_same_conversation(server):
    response = _respond(server, input="Hello there", instructions="Be brief.", max_output_tokens=10, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = _chat(server, messages, max_tokens=10, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 10
    assert response.usage.total_tokens == chat.usage.prompt_tokens + 10
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief."


def test_input_items_are_role_messages_with_text_parts(server):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
        {"role": "user", "content": "And again"},
    ]
    response = _respond(server, input=items, max_output_tokens=6, temperature=0)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello "},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "And again"},
    ]
    chat = _chat(server, messages, max_tokens=6, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_instructions_go_ahead_of_a_developer_message_in_one_system_message(server):
    items = [{"role": "developer", "content": "Use French."}, {"role": "user", "content": "Hello"}]
    response = _respond(server, input=items, instructions="Be brief.", max_output_tokens=4, temperature=0)
    messages = [{"role": "system", "content": "Be brief.\n\nUse French."}, {"role": "user", "content": "Hello"}]
    chat = _chat(server, messages, max_tokens=4, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_reassemble_to_the_whole_response(server):
    whole = _respond(server, input="Hello there", max_output_tokens=12, temperature=0)
    events = list(_respond(server, input="Hello there", max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens == 12


def test_function_tool_round_trip(server):
    tools = [WEATHER_TOOL]
    first = _respond(
        server,
        input=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}
    chained = _respond(
        server, input=[result], previous_response_id=first.id, tools=tools, max_output_tokens=8, temperature=0
    )
    assert chained.previous_response_id == first.id
    # The same conversation sent whole, without the stored response, is the same prompt.
    call_item = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    whole = _respond(
        server,
        input=[{"role": "user", "content": ASK}, call_item, result],
        tools=tools,
        max_output_tokens=8,
        temperature=0,
    )
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert chained.output_text == whole.output_text
    history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"},
    ]
    assert whole.usage.input_tokens == len(server.engine.tokenizer.encode_chat(history, tools=[WEATHER]))


def test_streamed_function_call_arguments(server):
    kwargs = dict(input=ASK, tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"})
    whole = _respond(server, max_output_tokens=120, temperature=0, **kwargs)
    events = list(_respond(server, max_output_tokens=120, temperature=0, stream=True, **kwargs))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == whole.output[0].arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == deltas


def test_json_schema_text_format(server):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = _respond(server, input=ASK, text={"format": fmt}, max_output_tokens=200, temperature=0.8)
    validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_stored_conversation(server):
    first = _respond(server, input="Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0)
    second = _respond(server, input="Tell me more", previous_response_id=first.id, max_output_tokens=6, temperature=0)
    messages = [
        {"role": "user", "content": "Hello there"},  # instructions are not carried over
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Tell me more"},
    ]
    chat = _chat(server, messages, max_tokens=6, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert server.openai().responses.retrieve(first.id).output_text == first.output_text


def test_unstored_and_unknown_responses_are_404_and_continuing_one_is_a_400(server):
    unstored = _respond(server, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        server.openai().responses.retrieve(unstored.id)
    response = server.http().post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": unstored.id}
    )
    assert_error(response, 400, "previous_response_id", "previous_response_not_found")
    stored = _respond(server, input="Hi", max_output_tokens=2)
    assert server.http().delete(f"/v1/responses/{stored.id}").json()["deleted"] is True
    assert_error(server.http().get(f"/v1/responses/{stored.id}"), 404)


def test_tool_choice_auto_without_tools_is_the_default_and_required_is_refused(server):
    # OpenAI's clients (and SGLang's tests) send tool_choice="auto" with no tools.
    response = _respond(server, input="Hi", max_output_tokens=2, tool_choice="auto", parallel_tool_calls=True)
    assert response.status == "incomplete" and response.tool_choice == "auto"
    refused = server.http().post("/v1/responses", json={"model": MODEL, "input": "Hi", "tool_choice": "required"})
    assert_error(refused, 400, "tool_choice")


def test_refusals_name_the_field(server):
    http = server.http()
    body = {"model": MODEL, "input": "Hi"}
    assert_error(http.post("/v1/responses", json={**body, "tools": [{"type": "web_search"}]}), 400, "tools[0].type")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    error = assert_error(
        http.post("/v1/responses", json={**body, "input": image}), 400, "input[0].content[0].image_url"
    )
    assert error["message"] == f"model {MODEL} reads text only; it cannot take images"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    assert_error(http.post("/v1/responses", json={**body, "input": audio}), 400, "input[0].content[0].type")
    assert_error(http.post("/v1/responses", json={**body, "max_output_tokens": 0}), 400, "max_output_tokens")
    assert_error(http.post("/v1/responses", json={**body, "background": True}), 400, "background")
    assert_error(http.post("/v1/responses", json={**body, "temprature": 1}), 400, "temprature")
    assert_serving(server)


def test_the_store_is_bounded_by_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put({"id": name}, [])
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    now[0] = 10.5
    store.put({"id": "d"}, [])
    assert store.get("b") is None and store.get("d") is not None
    now[0] = 20.0
    assert store.get("d") is not None
    now[0] = 20.6
    assert store.get("d") is None and len(store) == 0


def test_the_clients_stream_helper_assembles_the_final_response(server):
    # The helper needs response.completed (an answer cut by max_output_tokens ends with
    # response.incomplete, as OpenAI's do): a schema-bound answer ends by itself.
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    kwargs = dict(input=ASK, max_output_tokens=200, temperature=0, text={"format": fmt})
    whole = _respond(server, **kwargs)
    with server.openai().responses.stream(model=MODEL, **kwargs) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    assert text == final.output_text == whole.output_text
    validate(json.loads(text), PERSON)
