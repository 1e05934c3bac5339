"""POST /v1/chat/completions: OpenAI's chat body read into the chat core's request, answers as OpenAI sends them.

The route, then what this protocol adds to the chat core (chat.py) and the serving core
(serving.py): its choices (content, tool calls, logprobs) whole and streamed, and its body
(messages, tools, tool_choice, response_format, prefill) read into a ChatRequest.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from baselm.api import serving
from baselm.api.answer_text import AnswerText
from baselm.api.chat import ChatRequest, forces_call, parses_tools, prepare, read_tool, template_kwargs
from baselm.api.errors import bad_request
from baselm.api.images import ImageInput, from_url, image_part
from baselm.api.schemas import Body, array_field, check_choice, check_json_text, read_common
from baselm.api.state import ModelState
from baselm.request import RequestOutput
from baselm.sampling.params import TokenLogprobs
from baselm.toolcalls import parsers

_ROLES = ("system", "developer", "user", "assistant", "tool")


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    state, chat = await serving.read_request(request, parse_chat)
    # Templates, tokenizing and grammar compiling can take a while: off the event loop.
    jobs = await asyncio.to_thread(prepare, state, chat)
    return await serving.respond(request, state, jobs, "messages", _ChatAnswer(state, chat, jobs[0].prompt_ids))


# ---- the answer ---------------------------------------------------------------------------


class _ChatAnswer(serving.ChoicesAnswer):
    """Chat choices from engine outputs: thinking, content, tool calls (one AnswerText per choice), logprobs."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ModelState, chat: ChatRequest, prompt_ids: list[int]) -> None:
        super().__init__(state, chat.common, chat.common.n)
        self.chat = chat
        fmt = state.tool_format if parses_tools(chat) else None
        forced = forces_call(chat)
        self.texts = [
            AnswerText.for_prompt(state, prompt_ids, fmt, chat.tools, forced) for _ in range(self.num_choices)
        ]
        n = self.num_choices  # the whole answer, per choice:
        self.reasoning = [""] * n
        self.content = [""] * n
        self.calls: list[list[parsers.ToolCall]] = [[] for _ in range(n)]
        self.logprobs_content: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def finish_reason(self, out: RequestOutput) -> str:
        reason = super().finish_reason(out)
        return "tool_calls" if reason == "stop" and self.texts[out.index].num_calls else reason

    def _logprobs_entries(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        tokenizer, num_top = self.state.tokenizer, self.chat.top_logprobs

        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = serving.token_text(tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top[:num_top]]} for e in entries
        ]

    # ---- whole ----------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        pieces = self.texts[out.index].feed(out.text, out.finished)
        self.reasoning[out.index] += pieces.reasoning
        self.content[out.index] += pieces.content
        self.calls[out.index] += pieces.calls
        if self.chat.logprobs:
            self.logprobs_content[out.index] += self._logprobs_entries(out.logprobs)
        if out.finished:
            self.finish_reasons[out.index] = self.finish_reason(out)

    def choice(self, index: int) -> dict[str, Any]:
        calls = self.calls[index]
        empty = None if calls or forces_call(self.chat) else ""
        message: dict[str, Any] = {"role": "assistant", "content": self.content[index] or empty}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        if self.reasoning[index]:
            message["reasoning_content"] = self.reasoning[index]
        logprobs = {"content": self.logprobs_content[index], "refusal": None} if self.chat.logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reasons[index]}

    # ---- streamed -------------------------------------------------------------------------

    def opening(self) -> list[str]:
        return [self.chunk([_delta(i, {"role": "assistant", "content": ""})]) for i in range(self.num_choices)]

    def events(self, out: RequestOutput) -> list[str]:
        return [self.chunk([delta]) for delta in self._deltas(out)]

    def _deltas(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The choice deltas of one output, a chunk each: content, then each call closed, then the finish."""
        pieces = self.texts[out.index].feed(out.text, out.finished)
        choices = []
        logprobs = None
        if self.chat.logprobs and out.logprobs:
            logprobs = {"content": self._logprobs_entries(out.logprobs), "refusal": None}
        if pieces.reasoning:
            choices.append(_delta(out.index, {"reasoning_content": pieces.reasoning}))
        if pieces.content or logprobs:
            choices.append(_delta(out.index, {"content": pieces.content}, logprobs))
        for call in pieces.calls:
            choices += [_delta(out.index, {"tool_calls": [delta]}) for delta in call.as_deltas()]
        if out.finished:
            choices.append(_delta(out.index, {}, None, self.finish_reason(out)))
        return choices


def _delta(index: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


# ---- the request body ---------------------------------------------------------------------


def parse_chat(data: Any) -> ChatRequest:
    """The checked chat body; a 400 naming the first field at fault."""
    body = Body(data)
    common = read_common(body)
    messages = [read_message(m, i) for i, m in enumerate(array_field(body.raw("messages"), "messages", required=True))]
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    logprobs = body.boolean("logprobs")
    top_logprobs = body.integer("top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    request = ChatRequest(common, messages, logprobs, top_logprobs or 0)
    request.response_format = _response_format(body.raw("response_format"))
    request.tools = [read_tool(t, i) for i, t in enumerate(array_field(body.raw("tools"), "tools"))]
    request.tool_choice = _tool_choice(body.raw("tool_choice"), request.tools)
    request.parallel_tool_calls = body.boolean("parallel_tool_calls", default=True)
    request.chat_template_kwargs = template_kwargs(body.raw("chat_template_kwargs"))
    _read_prefill(body, request)
    if request.response_format and request.tool_choice not in ("auto", "none"):
        raise bad_request("response_format cannot be combined with a tool_choice that forces a call", "response_format")
    request.regex = body.string("regex")
    if request.regex is not None and (request.response_format or forces_call(request)):
        raise bad_request("regex cannot be combined with response_format or a forced tool call", "regex")
    body.finish()
    return request


def _read_prefill(body: Body, request: ChatRequest) -> None:
    """add_generation_prompt and continue_final_message (vLLM's extensions): continuing the final
    message needs it to be the assistant's, and no generation prompt after it."""
    request.continue_final_message = body.boolean("continue_final_message")
    request.add_generation_prompt = body.boolean("add_generation_prompt", default=not request.continue_final_message)
    if request.continue_final_message:
        if request.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        if request.messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's", "continue_final_message"
            )


def read_message(data: Any, index: int) -> dict[str, Any]:
    """messages[index] as the chat template takes it (a developer message becomes a system one)."""
    where = f"messages[{index}]"
    body = Body(data, where)
    role = check_choice(body.string("role", required=True), _ROLES, f"{where}.role")
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = body.raw("content")
    if content is None and not (role == "assistant" and body.has("tool_calls")):
        raise bad_request(f"{where}.content is required", f"{where}.content")
    message["content"] = _content(content, where) if content is not None else None  # None beside tool_calls
    name = body.string("name")
    if name is not None:
        message["name"] = name
    if role == "tool":
        message["tool_call_id"] = body.string("tool_call_id", required=True)
    if role == "assistant":
        calls = array_field(body.raw("tool_calls"), f"{where}.tool_calls")
        if calls:
            message["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
        reasoning = body.string("reasoning_content")
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if body.raw("refusal") is not None:
            raise bad_request(f"{where}.refusal is not supported; put the text in content", f"{where}.refusal")
    body.finish()
    return message


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        part_where = f"{where}.content[{i}]"
        body = Body(part, part_where)
        kind = body.string("type", required=True)
        if kind == "text":
            parts.append({"type": "text", "text": body.string("text", required=True)})
        elif kind == "image_url":
            parts.append(image_part(_image_url(body.raw("image_url"), f"{part_where}.image_url")))
        else:
            raise bad_request(
                f"{part_where} has type {kind!r}; this server reads text and image_url parts (no audio or files)",
                f"{part_where}.type",
            )
        body.finish()
    return parts


def _image_url(value: Any, where: str) -> ImageInput:
    """`image_url`: {"url": ..., "detail": ...} (a bare URL string also taken); detail is not used."""
    if isinstance(value, str):
        return from_url(value, where)
    body = Body(value, where)
    image = from_url(body.string("url", required=True), f"{where}.url")
    check_choice(body.string("detail", default="auto"), ("auto", "low", "high"), f"{where}.detail")
    body.finish()
    return image


def _history_call(data: Any, where: str) -> dict[str, Any]:
    body = Body(data, where)
    call_id = body.string("id", required=True)
    if body.string("type", default="function") != "function":
        raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
    function = Body(body.raw("function"), f"{where}.function")
    name = function.string("name", required=True)
    arguments = function.string("arguments", required=True)
    check_json_text(arguments, f"{where}.function.arguments")  # the chat template parses it
    function.finish()
    body.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto" if tools else "none"
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {value!r} is not none, auto, required or a function", "tool_choice")
        return value
    body = Body(value, "tool_choice")
    if body.string("type", required=True) != "function":
        raise bad_request("tool_choice.type must be 'function'", "tool_choice")
    fn = Body(body.raw("function"), "tool_choice.function")
    name = fn.string("name", required=True)
    fn.finish()
    body.finish()
    if name not in {t["function"]["name"] for t in tools}:
        names = ", ".join(t["function"]["name"] for t in tools)
        raise bad_request(
            f"Tool {name!r} not found in tools list; tool_choice must name one of: {names}", "tool_choice"
        )
    return {"type": "function", "function": {"name": name}}


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    body = Body(value, "response_format")
    kind = body.string("type", required=True)
    if kind == "text":
        body.finish()
        return None
    if kind == "json_object":  # llama.cpp also takes a schema here
        schema = _schema(body.raw("schema"), "response_format.schema")
        body.finish()
        return {"type": "json_object"} if schema is None else {"type": "json_schema", "name": "", "schema": schema}
    if kind != "json_schema":
        raise bad_request(f"response_format.type {kind!r} is not text, json_object or json_schema", "response_format")
    spec = Body(body.raw("json_schema"), "response_format.json_schema")
    name = spec.string("name", default="")  # OpenAI's clients always send one; nothing here needs it
    spec.string("description")
    schema = _schema(spec.raw("schema"), "response_format.json_schema.schema")
    spec.boolean("strict")  # the output always follows the schema (grammar-constrained decoding)
    spec.finish()
    body.finish()
    return {"type": "json_schema", "name": name, "schema": schema if schema is not None else {}}


def _schema(value: Any, where: str) -> dict[str, Any] | bool | None:
    if value is not None and not isinstance(value, (dict, bool)):
        raise bad_request(f"{where} must be a JSON Schema object", "response_format")
    return value
