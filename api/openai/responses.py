"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

The body is read into a chat request (responses_request.py), run through the chat core (api/chat.py), and
answered as output items: a reasoning item (a reasoning model's thinking), a message item
(the text), one function_call item per tool call, in the order the model wrote them. A whole
answer and a stream are built by the same code: each piece of the answer becomes typed events
(response.output_item.added, response.output_text.delta, ...) and changes the output items,
so the items of `response.completed` are exactly the whole answer's.

A response that ran out of `max_output_tokens` has status "incomplete" with
incomplete_details.reason "max_output_tokens". Responses made with `store` (the default) are
kept in memory for `previous_response_id` (responses_store.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api import serving, sse
from baselm.api.answer_text import AnswerText
from baselm.api.chat import parses_tools, prepare
from baselm.api.errors import FIELD_ERRORS, APIError
from baselm.api.openai.responses_request import ResponsesRequest, parse_responses, with_instructions
from baselm.api.openai.responses_store import ResponseStore
from baselm.api.state import ModelState
from baselm.request import RequestOutput


async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    state, req = await serving.read_request(request, parse_responses)
    store: ResponseStore = request.app.state.responses
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise APIError(  # a field of this request, not the resource at its URL: 400, as OpenAI answers
                400,
                f"previous response {req.previous_response_id!r} was not found (responses are kept in memory "
                f"for {store.max_age_s / 60:g} minutes, the last {store.max_entries} of them, and only with store)",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = entry.conversation
    req.chat.messages = with_instructions(req.instructions, history + req.input_messages)
    jobs = await asyncio.to_thread(_prepare, state, req)
    answer = ResponseAnswer(state, req, jobs[0].prompt_ids, store, history)
    return await serving.respond(request, state, jobs, "input", answer)


def _prepare(state: ModelState, req: ResponsesRequest) -> list[serving.Job]:
    try:
        return prepare(state, req.chat)
    except (APIError, *FIELD_ERRORS) as exc:  # chat's names for the fields, in this API's words
        exc.param = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}.get(
            exc.param or "", exc.param
        )
        raise


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response."""
    entry = request.app.state.responses.get(request.path_params["response_id"])
    if entry is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(entry.response)


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{id}: forgets a stored response."""
    response_id = request.path_params["response_id"]
    if not request.app.state.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} was not found (or no longer kept)", code="response_not_found")


class ResponseAnswer(serving.Answer):
    """A response's output items from engine outputs, whole or as typed stream events."""

    id_prefix = "resp_"

    def __init__(
        self,
        state: ModelState,
        req: ResponsesRequest,
        prompt_ids: list[int],
        store: ResponseStore,
        history: list[dict[str, Any]],
    ) -> None:
        super().__init__(state, req.chat.common, 1)
        self.req = req
        self.store = store
        self.history = history
        self.text = AnswerText.for_prompt(
            state, prompt_ids, state.tool_format if parses_tools(req.chat) else None, req.chat.tools
        )
        self.output: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the reasoning or message item being written
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete_details: dict[str, str] | None = None
        self.num_reasoning_tokens = 0

    # ---- the response object --------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        req, sampling = self.req, self.common.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "error": None,
            "incomplete_details": self.incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": sampling["max_tokens"],
            "model": self.state.model_name,
            "output": self.output,
            "parallel_tool_calls": req.chat.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "text": {"format": req.text_format},
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "truncation": "disabled",
            "metadata": req.metadata,
            "usage": self._usage() if self.status != "in_progress" else None,
        }

    def _usage(self) -> dict[str, Any]:
        counts = self.usage.as_dict()
        return {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens},
            "total_tokens": counts["total_tokens"],
        }

    def _finish(self) -> dict[str, Any]:
        """The finished response, stored when asked."""
        response = self.response()
        if self.req.store:
            self.store.put(response, self.history + self.req.input_messages + [self._assistant_message()])
        return response

    def _assistant_message(self) -> dict[str, Any]:
        """This response's output as the chat message a next turn's template sees."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        calls = []
        for item in self.output:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            else:
                function = {"name": item["name"], "arguments": item["arguments"]}
                calls.append({"id": item["call_id"], "type": "function", "function": function})
        if calls:
            message["tool_calls"] = calls
        return message

    # ---- whole and streamed ---------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        self._apply(out)

    def whole(self) -> dict[str, Any]:
        return self._finish()

    def opening(self) -> list[str]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def events(self, out: RequestOutput) -> list[str]:
        return self._apply(out)

    def closing(self) -> list[str]:
        response = self._finish()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def error_events(self, exc: Exception) -> list[str]:
        error = sse.stream_error(exc)
        return [self._event("error", code=error.code, message=error.message, param=error.param)]

    # ---- output items ---------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse.named_event(kind, payload)

    def _apply(self, out: RequestOutput) -> list[str]:
        """The events of one output; the output items change to match."""
        if out.finish_reason == "abort":
            raise APIError(503, "the server is shutting down; the request was stopped")
        pieces = self.text.feed(out.text, out.finished)
        if self.text.splitter is not None and (self.text.splitter.state in ("thinking", "after") or pieces.reasoning):
            self.num_reasoning_tokens += len(out.token_ids)
        events = []
        if pieces.reasoning:
            events += self._write("reasoning", pieces.reasoning)
        if pieces.content:
            events += self._write("message", pieces.content)
        for call in pieces.calls:
            events += self._close() + self._call(call.id, call.name, call.arguments)
        if out.finished:
            events += self._close()
            self.status = "incomplete" if out.finish_reason == "length" else "completed"
            if self.status == "incomplete":
                self.incomplete_details = {"reason": "max_output_tokens"}
        return events

    def _write(self, kind: str, text: str) -> list[str]:
        """Text onto the open item of `kind` (opening it, and closing another, first)."""
        events = []
        if self.current is not None and self.current["type"] != kind:
            events += self._close()
        if self.current is None:
            events += self._open(kind)
        item, index = self.current, len(self.output) - 1
        item["content"][0]["text"] += text
        if kind == "message":
            events.append(self._event("response.output_text.delta", **_where(item, index), delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **_where(item, index), delta=text))
        return events

    def _open(self, kind: str) -> list[str]:
        if kind == "message":
            item = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        item["content"] = []
        self.output.append(item)
        self.current = item
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        item["content"].append(part)
        events.append(self._event("response.content_part.added", **_where(item, index), part=part))
        return events

    def _close(self) -> list[str]:
        item, self.current = self.current, None
        if item is None:
            return []
        index, part = len(self.output) - 1, item["content"][0]
        item["status"] = "completed"
        if item["type"] == "message":
            done = self._event("response.output_text.done", **_where(item, index), text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **_where(item, index), text=part["text"])
        return [
            done,
            self._event("response.content_part.done", **_where(item, index), part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call_id: str, name: str, arguments: str) -> list[str]:
        item = {
            "id": _new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        self.output.append(item)
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
        ]
        item.update(arguments=arguments, status="completed")
        events.append(self._event("response.function_call_arguments.done", **where, name=name, arguments=arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events


def _where(item: dict[str, Any], index: int) -> dict[str, Any]:
    return {"item_id": item["id"], "output_index": index, "content_index": 0}


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
