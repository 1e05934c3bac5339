"""An error after a stream's headers went out ends the stream with one error event in the API's own
shape (Responses: a typed `error` event; Messages: Anthropic's `error` event), never a traceback."""

from __future__ import annotations

import asyncio
import json

from baselm.api.anthropic.messages import MessageAnswer
from baselm.api.anthropic.request import parse_messages
from baselm.api.errors import APIError
from baselm.api.openai.responses import ResponseAnswer
from baselm.api.openai.responses_request import parse_responses
from baselm.api.openai.responses_store import ResponseStore
from baselm.api.state import ModelState, ServerState
from baselm.request import RequestOutput
from tests.api.conftest import MODEL


async def _failing(error: Exception):
    """Engine outputs: one piece of text, then `error`."""
    yield RequestOutput("r", text="Hi", token_ids=[5], num_prompt_tokens=3, num_output_tokens=1)
    raise error


def _events(answer, error: Exception) -> list[tuple[str, dict]]:
    async def run() -> list[str]:
        return [chunk async for chunk in answer.stream(_failing(error))]

    events = []
    for chunk in asyncio.run(run()):
        name, data = chunk.strip().split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_responses_stream_ends_with_a_typed_error_event(server):
    state = ModelState.serving(server.client, MODEL, ServerState())
    req = parse_responses({"model": MODEL, "input": "Hi", "stream": True})
    answer = ResponseAnswer(state, req, [1, 2, 3], ResponseStore(), [])
    events = _events(answer, APIError(503, "the server is shutting down"))
    assert [name for name, _ in events][-2:] == ["response.output_text.delta", "error"]
    name, error = events[-1]
    assert error == {
        "type": "error",
        "code": None,
        "message": "the server is shutting down",
        "param": None,
        "sequence_number": len(events) - 1,
    }
    _, bug = _events(ResponseAnswer(state, req, [1, 2, 3], ResponseStore(), []), RuntimeError("secret detail"))[-1]
    assert bug["type"] == "error" and "secret" not in bug["message"]


def test_messages_stream_ends_with_an_anthropic_error_event(server):
    state = ModelState.serving(server.client, MODEL, ServerState())
    chat = parse_messages({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    events = _events(MessageAnswer(state, chat, [1, 2, 3]), APIError(503, "the server is shutting down"))
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is shutting down"},
    }
    _, bug = _events(MessageAnswer(state, chat, [1, 2, 3]), RuntimeError("secret detail"))[-1]
    assert bug["error"]["type"] == "api_error" and "secret" not in bug["error"]["message"]
