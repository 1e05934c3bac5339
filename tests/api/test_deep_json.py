"""JSON nested deeper than 64 levels (counting the request body as one) is a 400 in each API's own
error body, refused before the chat template, the grammar or any other recursive code sees it."""

from __future__ import annotations

import json
from typing import Any

from tests.api.conftest import MODEL
from tests.api.test_errors import assert_error, assert_serving

HELLO = [{"role": "user", "content": "Hello"}]
MAX_DEPTH = 64


def nested_list(depth: int) -> Any:
    """`[[...[0]...]]`: JSON `depth` levels deep."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema whose one property is an object schema, `levels` times (two JSON levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def openai_forced_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    choice = {"type": "function", "function": {"name": "f"}}
    return {"model": MODEL, "messages": HELLO, "tools": tools, "tool_choice": choice, "max_tokens": 2}


def test_a_forced_tool_with_a_400_level_schema_is_400_in_openai_chat(server):
    response = server.http().post("/v1/chat/completions", json=openai_forced_tool(nested_schema(400)))
    error = assert_error(response, 400, "tools")
    assert error["message"] == "tools nests JSON deeper than 64 levels (counting the request body); flatten it"
    assert_serving(server)


def test_a_forced_tool_with_a_400_level_schema_is_400_in_anthropic_messages(server):
    tools = [{"name": "f", "input_schema": nested_schema(400)}]
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": HELLO,
        "tools": tools,
        "tool_choice": {"type": "tool", "name": "f"},
    }
    response = server.http().post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "tools nests JSON deeper than 64 levels (counting the request body); flatten it",
        },
    }


def test_a_400_level_tool_schema_and_format_are_400_in_ollama_chat(server):
    http = server.http()
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested_schema(400)}}]
    body = {"model": MODEL, "messages": HELLO, "tools": tools, "stream": False}
    response = http.post("/api/chat", json=body)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": "tools nests JSON deeper than 64 levels (counting the request body); flatten it"
    }
    response = http.post("/api/chat", json={"model": MODEL, "messages": HELLO, "format": nested_schema(400)})
    assert response.status_code == 400 and "format nests JSON deeper than 64 levels" in response.json()["error"]


def test_message_content_and_template_variables_nested_past_the_limit_are_400(server):
    http = server.http()
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(nested_list(400))}}]
    messages = [*HELLO, {"role": "assistant", "content": None, "tool_calls": calls}]
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    error = assert_error(response, 400, "messages[1].tool_calls[0].function.arguments")
    assert "nests JSON deeper than 64 levels" in error["message"]
    too_deep = {"x": nested_list(MAX_DEPTH - 1)}  # the body, chat_template_kwargs, then the list: 65 levels
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "chat_template_kwargs": too_deep}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs")
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps(nested_list(400))}
    response = http.post("/v1/responses", json={"model": MODEL, "input": [call], "max_output_tokens": 2})
    assert_error(response, 400, "input[0].arguments")
    tool_use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": nested_list(400)}}
    messages = [*HELLO, {"role": "assistant", "content": [tool_use]}]
    response = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": messages})
    assert response.status_code == 400 and "messages nests JSON deeper" in response.json()["error"]["message"]


def test_json_at_the_limit_is_served(server):
    http = server.http()
    deepest = {"x": nested_list(MAX_DEPTH - 2)}  # the body, chat_template_kwargs, then the list: 64 levels
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "chat_template_kwargs": deepest}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    # 30 nested objects: the body's 3 levels down to the schema, then 61 (a schema the prompt would not hold).
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(30)}}
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "response_format": fmt, "max_tokens": 8}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith('{"a"')
