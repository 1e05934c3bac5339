"""A grammar the server cannot enforce is a 400 naming the request's field, in each protocol's body."""

from __future__ import annotations

import httpx

from tests.api.conftest import MODEL

HELLO = [{"role": "user", "content": "Hello"}]
BAD = {"type": "object", "properties": {"a": {"type": 7}}}  # llguidance refuses it
REFUSED = "cannot be enforced: "


def _openai_error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert {k: v for k, v in error.items() if k != "message"} == {
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    return error["message"]


def test_chat_names_response_format_a_tools_schema_or_min_tokens(server):
    http = server.http()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "response_format": fmt})
    assert _openai_error(response, "response_format").startswith("response_format " + REFUSED)
    tools = [{"type": "function", "function": {"name": "g", "parameters": BAD}}]
    body = {"model": MODEL, "messages": HELLO, "tools": tools, "tool_choice": "required"}
    message = _openai_error(http.post("/v1/chat/completions", json=body), "tools[0].function.parameters")
    assert message.startswith("invalid 'parameters' schema in tools[0].function.parameters (g): ")
    body = {"model": MODEL, "messages": HELLO, "min_tokens": 3, "response_format": {"type": "json_object"}}
    assert _openai_error(http.post("/v1/chat/completions", json=body), "min_tokens") == (
        "min_tokens cannot be combined with response_format (the grammar decides where the answer ends)"
    )


def test_responses_name_text(server):
    fmt = {"type": "json_schema", "name": "x", "schema": BAD}
    response = server.http().post("/v1/responses", json={"model": MODEL, "input": "Hello", "text": {"format": fmt}})
    assert _openai_error(response, "text").startswith("response_format " + REFUSED)


def test_messages_answer_in_anthropics_body(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5}
    fmt = {"type": "json_schema", "schema": BAD}
    response = server.http().post("/v1/messages", json={**body, "output_config": {"format": fmt}})
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("response_format " + REFUSED)


def test_ollama_answers_one_string_naming_format(server):
    http = server.http()
    for path, body in (("/api/chat", {"messages": HELLO}), ("/api/generate", {"prompt": "Hello"})):
        response = http.post(path, json={"model": MODEL, **body, "format": BAD, "stream": False})
        assert response.status_code == 400
        assert list(response.json()) == ["error"]
        assert response.json()["error"].startswith("format " + REFUSED)
