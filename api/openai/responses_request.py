"""The body of POST /v1/responses, read into the chat core's request (api/chat.py).

`input` (a string, or items: role messages, function calls, their outputs, reasoning) becomes
chat messages; `instructions` a leading system message; function `tools`, `tool_choice` and
`text.format` their chat equivalents, so prompt building, grammars and tool-call parsing are
the chat core's own (api/chat.py). Fields are honoured or refused by name, as in
schemas.py; a few that only steer OpenAI's hosted service are accepted and ignored
(`include`, `metadata`, `prompt_cache_key`, `safety_identifier`, `service_tier`, `truncation`
"disabled", `user`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baselm.api.chat import ChatRequest, read_function
from baselm.api.errors import bad_request
from baselm.api.images import ImageInput, from_url, image_part
from baselm.api.schemas import Body, Common, array_field, check_choice, check_json_text

_IGNORED = ("include", "metadata", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "service_tier")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses body: the chat request to run and what the response object echoes."""

    chat: ChatRequest
    instructions: str | None
    input_messages: list[dict[str, Any]]  # this turn's input as chat messages (no instructions)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})

    @property
    def common(self) -> Common:
        return self.chat.common


def parse_responses(data: Any) -> ResponsesRequest:
    """The checked Responses body; a 400 naming the first field at fault."""
    body = Body(data)
    common = _common(body)
    instructions = body.string("instructions")
    raw_input = body.raw("input")
    if raw_input is None:
        raise bad_request("input is required: a string or an array of input items", "input")
    messages = input_messages(raw_input)
    tools = [_tool(t, i) for i, t in enumerate(array_field(body.raw("tools"), "tools"))]
    chat = ChatRequest(common, messages, tools=[{"type": "function", "function": t} for t in tools])
    chat.tool_choice = _tool_choice(body.raw("tool_choice"), tools)
    chat.parallel_tool_calls = body.boolean("parallel_tool_calls", default=True)
    text_format = _text(body.raw("text"))
    chat.response_format = _response_format(text_format)
    chat.chat_template_kwargs = _reasoning(body.raw("reasoning"))
    if chat.response_format and chat.tool_choice not in ("auto", "none"):
        raise bad_request("text.format cannot be combined with a tool_choice that forces a call", "text")
    request = ResponsesRequest(chat, instructions, messages, tools=[{"type": "function", **t} for t in tools])
    request.tool_choice = body.raw("tool_choice") or ("auto" if tools else "none")
    request.text_format = text_format
    request.previous_response_id = body.string("previous_response_id")
    request.store = body.boolean("store", default=True)
    request.metadata = _metadata(body.raw("metadata"))
    _refuse_hosted_features(body)
    body.finish()
    return request


def _common(body: Body) -> Common:
    model = body.string("model", required=True)
    stream = body.boolean("stream")
    sampling: dict[str, Any] = {
        "n": 1,
        "temperature": body.number("temperature"),
        "top_p": body.number("top_p"),
        "max_tokens": body.integer("max_output_tokens"),
        "min_tokens": 0,
        "ignore_eos": False,
    }
    return Common(model, stream, False, 1, sampling, "max_output_tokens")


def _refuse_hosted_features(body: Body) -> None:
    for name in _IGNORED:
        body.raw(name)
    truncation = body.string("truncation", default="disabled")
    if truncation != "disabled":
        raise bad_request("truncation 'auto' is not supported; the prompt must fit the context", "truncation")
    for name in ("background", "conversation", "prompt", "top_logprobs", "max_tool_calls", "stream_options"):
        value = body.raw(name)
        if value not in (None, False):
            raise bad_request(f"{name} is not supported by this server", name)


def _metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise bad_request("metadata must be an object of string values", "metadata")
    return dict(value)


def with_instructions(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` after the instructions' system message; a system message already first takes the
    instructions ahead of its own text (chat templates allow one system message, first)."""
    if not instructions:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{instructions}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


# ---- input items --------------------------------------------------------------------------


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages from `input`: role messages as they are, a run of function calls as one
    assistant turn's tool_calls, function outputs as tool messages, reasoning onto the next assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    items = array_field(value, "input")
    if not items:
        raise bad_request("input must hold at least one item", "input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        body = Body(item, where)
        kind = body.string("type", default="message")
        body.string("id")
        body.raw("status")
        if kind == "message":
            messages.append(_message(body, where))
        elif kind == "function_call":
            _append_call(messages, body, where)
        elif kind == "function_call_output":
            call_id = body.string("call_id", required=True)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _output(body.raw("output"), where)})
        elif kind == "reasoning":
            reasoning.append(_reasoning_item(body, where))
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported by this server", f"{where}.type")
        body.finish()
        if reasoning and messages and messages[-1]["role"] == "assistant" and kind != "reasoning":
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return messages


def _message(body: Body, where: str) -> dict[str, Any]:
    """A message item; its text parts joined, or kept as parts beside `input_image` ones."""
    role = check_choice(body.string("role", required=True), _ROLES, f"{where}.role")
    content = body.raw("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    items = array_field(content, f"{where}.content", required=True)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(items):
        part_where = f"{where}.content[{i}]"
        part_body = Body(part, part_where)
        kind = part_body.string("type", required=True)
        if kind == "input_image":
            parts.append(image_part(_input_image(part_body, part_where)))
        elif kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part_body.string("text", required=True)})
            part_body.raw("annotations")
            part_body.raw("logprobs")
        else:
            raise bad_request(
                f"{part_where} has type {kind!r}; this server reads text and input_image parts (no audio or files)",
                f"{part_where}.type",
            )
        part_body.finish()
    if any(p["type"] == "image" for p in parts):
        return {"role": _ROLES[role], "content": parts}
    return {"role": _ROLES[role], "content": "".join(p["text"] for p in parts)}


def _input_image(body: Body, where: str) -> ImageInput:
    """An `input_image` part: its `image_url` (a data URL or http(s)); uploaded files are not kept here."""
    if body.raw("file_id") is not None:
        raise bad_request(f"{where}.file_id is not supported; send the image as image_url", f"{where}.file_id")
    image = from_url(body.string("image_url", required=True), f"{where}.image_url")
    check_choice(body.string("detail", default="auto"), ("auto", "low", "high"), f"{where}.detail")
    return image


def _append_call(messages: list[dict[str, Any]], body: Body, where: str) -> None:
    call_id, name = body.string("call_id", required=True), body.string("name", required=True)
    arguments = body.string("arguments", required=True)
    check_json_text(arguments, f"{where}.arguments")  # the chat template parses it
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _output(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    parts = array_field(value, f"{where}.output", required=True)
    texts = []
    for i, part in enumerate(parts):
        part_body = Body(part, f"{where}.output[{i}]")
        if part_body.string("type", required=True) != "input_text":
            raise bad_request(f"{where}.output[{i}] must be an input_text part", f"{where}.output")
        texts.append(part_body.string("text", required=True))
        part_body.finish()
    return "".join(texts)


def _reasoning_item(body: Body, where: str) -> str:
    body.raw("encrypted_content")
    texts = []
    for name in ("content", "summary"):
        for i, part in enumerate(array_field(body.raw(name), f"{where}.{name}")):
            part_body = Body(part, f"{where}.{name}[{i}]")
            part_body.string("type", required=True)
            texts.append(part_body.string("text", required=True))
            part_body.finish()
    return "".join(texts[:1])  # the full text when given, else the summary


# ---- tools, tool_choice, text.format, reasoning --------------------------------------------


def _tool(data: Any, index: int) -> dict[str, Any]:
    """tools[index] (a function tool, flat as Responses writes it) as the chat function it is."""
    where = f"tools[{index}]"
    body = Body(data, where)
    kind = body.string("type", required=True)
    if kind != "function":
        raise bad_request(f"{where}.type {kind!r} is not supported; this server runs function tools", f"{where}.type")
    function = read_function(body, where)
    body.finish()
    return function


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {value!r} is not none, auto, required or a function", "tool_choice")
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return value if tools else "none"  # "auto" is the default, tools or not
    body = Body(value, "tool_choice")
    if body.string("type", required=True) != "function":
        raise bad_request("tool_choice.type must be 'function'", "tool_choice")
    name = body.string("name", required=True)
    body.finish()
    if name not in {t["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _text(value: Any) -> dict[str, Any]:
    """text.format as the request gave it (checked); {"type": "text"} when absent."""
    if value is None:
        return {"type": "text"}
    body = Body(value, "text")
    body.string("verbosity")
    fmt = body.raw("format")
    body.finish()
    if fmt is None:
        return {"type": "text"}
    spec = Body(fmt, "text.format")
    kind = spec.string("type", required=True)
    if kind == "json_schema":
        spec.string("name", required=True)
        spec.string("description")
        spec.boolean("strict")  # the output always follows the schema (grammar-constrained decoding)
        schema = spec.raw("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("text.format.schema must be a JSON Schema object", "text")
    elif kind not in ("text", "json_object"):
        raise bad_request(f"text.format.type {kind!r} is not text, json_object or json_schema", "text")
    spec.finish()
    return dict(fmt)


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"]}


def _reasoning(value: Any) -> dict[str, Any]:
    """`reasoning.effort` "none" turns a reasoning model's thinking off; any other effort leaves it on."""
    if value is None:
        return {}
    body = Body(value, "reasoning")
    effort = body.string("effort")
    body.raw("summary")
    body.raw("generate_summary")
    body.finish()
    if effort is None:
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad_request(f"reasoning.effort {effort!r} is not none, minimal, low, medium or high", "reasoning")
    return {"enable_thinking": effort != "none"}
