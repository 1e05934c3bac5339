"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), and its error shape.

The body is read into a chat request (request.py) and run through the chat core (api/chat.py).
The answer is content blocks in the order the model wrote them: `thinking` (a reasoning
model's), `text`, one `tool_use` per call. A whole answer and a stream are built by the same
code: each piece becomes stream events (content_block_start / _delta / _stop) and changes
the blocks, so a stream's blocks are exactly the whole answer's.

Every refusal on these routes has Anthropic's body
`{"type": "error", "error": {"type": ..., "message": ...}}`, in a stream too (an `error`
event). `stop_reason` is "end_turn", "max_tokens", "stop_sequence" (with `stop_sequence`
set) or "tool_use". The `anthropic-version` header is accepted and not checked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api import serving, sse
from baselm.api.answer_text import AnswerText
from baselm.api.anthropic.request import parse_messages
from baselm.api.chat import ChatRequest, encode_prompt, parses_tools, prepare
from baselm.api.errors import FIELD_ERRORS, APIError, anthropic_error_body, api_error, logger
from baselm.api.state import ModelState
from baselm.request import RequestOutput

Handler = Callable[[Request], Awaitable[Response]]


def _with_anthropic_errors(handler: Handler) -> Handler:
    """`handler` with its refusals (and bugs) answered in Anthropic's error body."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except (APIError, *FIELD_ERRORS) as refusal:
            exc = api_error(refusal)
            message = f"{exc.param}: {exc.message}" if exc.param and exc.param not in exc.message else exc.message
            return JSONResponse(anthropic_error_body(exc.status, message), exc.status, headers=exc.headers)
        except Exception as exc:  # a bug: logged, and told without a traceback
            logger.exception("internal error on %s", request.url.path, exc_info=exc)
            message = "the server hit an internal error; the request was not completed"
            return JSONResponse(anthropic_error_body(500, message), 500)

    return route


@_with_anthropic_errors
async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    state, chat = await serving.read_request(request, parse_messages)
    jobs = await asyncio.to_thread(prepare, state, chat)
    return await serving.respond(request, state, jobs, "messages", MessageAnswer(state, chat, jobs[0].prompt_ids))


@_with_anthropic_errors
async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": the prompt's length}."""
    state, chat = await serving.read_request(request, lambda data: parse_messages(data, counting=True))
    prompt_ids, _ = await asyncio.to_thread(encode_prompt, state, chat)
    return JSONResponse({"input_tokens": len(prompt_ids)})


class MessageAnswer(serving.Answer):
    """A message's content blocks from engine outputs, whole or as stream events."""

    id_prefix = "msg_"

    def __init__(self, state: ModelState, chat: ChatRequest, prompt_ids: list[int]) -> None:
        super().__init__(state, chat.common, 1)
        self.chat = chat
        self.num_prompt_tokens = len(prompt_ids)
        self.text = AnswerText.for_prompt(
            state, prompt_ids, state.tool_format if parses_tools(chat) else None, chat.tools
        )
        self.content: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the thinking or text block being written
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self._usage(),
        }

    def _usage(self) -> dict[str, Any]:
        counts = self.usage.as_dict()
        cached = counts["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": (counts["prompt_tokens"] or self.num_prompt_tokens) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": counts["completion_tokens"],
        }

    # ---- whole and streamed ---------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        self._apply(out)

    def whole(self) -> dict[str, Any]:
        return self.message()

    def opening(self) -> list[str]:
        start = {**self.message(), "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}}
        return [_event("message_start", message=start), _event("ping")]

    def events(self, out: RequestOutput) -> list[str]:
        return self._apply(out)

    def closing(self) -> list[str]:
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [_event("message_delta", delta=delta, usage=self._usage()), _event("message_stop")]

    def error_events(self, exc: Exception) -> list[str]:
        error = sse.stream_error(exc)
        return [sse.named_event("error", anthropic_error_body(error.status, error.message))]

    # ---- content blocks -------------------------------------------------------------------

    def _apply(self, out: RequestOutput) -> list[str]:
        """The events of one output; the content blocks change to match."""
        if out.finish_reason == "abort":
            raise APIError(503, "the server is shutting down; the request was stopped")
        pieces = self.text.feed(out.text, out.finished)
        events = []
        if pieces.reasoning:
            events += self._write("thinking", pieces.reasoning)
        if pieces.content:
            events += self._write("text", pieces.content)
        for call in pieces.calls:
            events += self._close() + self._tool_use(call.id, call.name, call.arguments)
        if out.finished:
            events += self._close()
            self._set_stop_reason(out)
        return events

    def _set_stop_reason(self, out: RequestOutput) -> None:
        if out.finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif self.text.num_calls:
            self.stop_reason = "tool_use"
        elif isinstance(out.stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", out.stop_reason
        else:
            self.stop_reason = "end_turn"

    def _write(self, kind: str, text: str) -> list[str]:
        events = []
        if self.current is not None and self.current["type"] != kind:
            events += self._close()
        if self.current is None:
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.content.append(block)
            self.current = block
            events.append(_event("content_block_start", index=len(self.content) - 1, content_block=block))
        self.current[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(_event("content_block_delta", index=len(self.content) - 1, delta=delta))
        return events

    def _close(self) -> list[str]:
        if self.current is None:
            return []
        self.current = None
        return [_event("content_block_stop", index=len(self.content) - 1)]

    def _tool_use(self, call_id: str, name: str, arguments: str) -> list[str]:
        block = {"type": "tool_use", "id": call_id.replace("call_", "toolu_", 1), "name": name, "input": {}}
        self.content.append(block)
        index = len(self.content) - 1
        events = [_event("content_block_start", index=index, content_block=block)]
        block["input"] = json.loads(arguments)
        delta = {"type": "input_json_delta", "partial_json": arguments}
        events += [_event("content_block_delta", index=index, delta=delta), _event("content_block_stop", index=index)]
        return events


def _event(kind: str, **fields: Any) -> str:
    return sse.named_event(kind, {"type": kind, **fields})
