"""The body of POST /v1/messages (Anthropic's Messages API), read into the chat core's request (api/chat.py).

`system` (a string or text blocks) becomes a leading system message; each message's content
blocks become chat messages: text as content, `tool_use` blocks as the assistant's
tool_calls, `tool_result` blocks as tool messages, `thinking` blocks as the assistant's
reasoning_content. Tools (`input_schema`), `tool_choice` (auto, any, tool, none) and
`thinking` map to their chat equivalents. `cache_control` marks and `metadata` are accepted
and ignored (prefix caching is automatic here); images go to the chat core (images.py), documents are refused.
"""

from __future__ import annotations

import json
from typing import Any

from baselm.api.chat import ChatRequest, read_function
from baselm.api.errors import bad_request
from baselm.api.images import ImageInput, from_base64, from_url, image_part
from baselm.api.schemas import Body, Common, array_field, check_choice

_IGNORED = ("metadata", "service_tier", "cache_control", "inference_geo", "speed")


def parse_messages(data: Any, counting: bool = False) -> ChatRequest:
    """The checked Messages body as a chat request; `counting` (count_tokens) needs no max_tokens.

    `output_config.format` (a JSON schema) is enforced as chat's response_format is."""
    body = Body(data)
    common = _common(body, counting)
    system = _system(body.raw("system"))
    messages = system + _messages(body.raw("messages"))
    tools = [_tool(t, i) for i, t in enumerate(array_field(body.raw("tools"), "tools"))]
    chat = ChatRequest(common, messages, tools=tools)
    chat.tool_choice, chat.parallel_tool_calls = _tool_choice(body.raw("tool_choice"), tools)
    chat.chat_template_kwargs = _thinking(body.raw("thinking"))
    chat.response_format = _output_format(body.raw("output_config"))
    if chat.response_format and chat.tool_choice not in ("auto", "none"):
        message = "output_config.format cannot be combined with a tool_choice that forces a call"
        raise bad_request(message, "output_config")
    for name in _IGNORED:
        body.raw(name)
    for name in ("container", "mcp_servers"):
        if body.raw(name) is not None:
            raise bad_request(f"{name} is not supported by this server", name)
    body.finish()
    return chat


def _common(body: Body, counting: bool) -> Common:
    model = body.string("model", required=True)
    if counting:
        return Common(model, False, False, 1, {}, "max_tokens")
    stream = body.boolean("stream")
    max_tokens = body.integer("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    stop = array_field(body.raw("stop_sequences"), "stop_sequences")
    if not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop_sequences must be an array of non-empty strings", "stop_sequences")
    sampling: dict[str, Any] = {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": body.number("temperature", low=0.0, high=1.0),
        "top_p": body.number("top_p"),
        "top_k": body.integer("top_k"),
        "stop": stop,
        "min_tokens": 0,
        "ignore_eos": False,
    }
    return Common(model, stream, False, 1, sampling, "max_tokens")


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    blocks = array_field(value, "system")
    text = "\n".join(_text_block(b, f"system[{i}]") for i, b in enumerate(blocks))
    return [{"role": "system", "content": text}] if blocks else []


def _text_block(data: Any, where: str) -> str:
    body = Body(data, where)
    kind = body.string("type", required=True)
    if kind != "text":
        raise bad_request(f"{where}.type must be 'text'", f"{where}.type")
    text = body.string("text", required=True)
    body.raw("cache_control")
    body.raw("citations")
    body.finish()
    return text


# ---- messages and their content blocks ----------------------------------------------------


def _messages(value: Any) -> list[dict[str, Any]]:
    items = array_field(value, "messages", required=True)
    if not items:
        raise bad_request("messages must hold at least one message", "messages")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"messages[{index}]"
        body = Body(item, where)
        role = body.string("role", required=True)
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role {role!r} is not user or assistant", f"{where}.role")
        content = body.raw("content")
        body.finish()
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif role == "user":
            messages += _user_blocks(array_field(content, f"{where}.content", required=True), where)
        else:
            messages.append(_assistant_blocks(array_field(content, f"{where}.content", required=True), where))
    return messages


def _block(data: Any, where: str, allowed: tuple[str, ...]) -> tuple[str, Body]:
    body = Body(data, where)
    kind = body.string("type", required=True)
    if kind not in allowed:
        raise bad_request(
            f"{where} has type {kind!r}; this server reads {', '.join(allowed)} blocks here (no documents)",
            f"{where}.type",
        )
    body.raw("cache_control")
    return kind, body


def _user_blocks(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, then its text (and images, in place) as one user message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, data in enumerate(blocks):
        block_where = f"{where}.content[{i}]"
        kind, body = _block(data, block_where, ("text", "image", "tool_result"))
        if kind == "text":
            parts.append({"type": "text", "text": body.string("text", required=True)})
            body.raw("citations")
        elif kind == "image":
            parts.append(image_part(_image_source(body.raw("source"), f"{block_where}.source")))
        else:
            call_id = body.string("tool_use_id", required=True)
            content = _result_content(body.raw("content"), block_where)
            if body.boolean("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": content})
        body.finish()
    if any(p["type"] == "image" for p in parts):
        return [*results, {"role": "user", "content": parts}]
    text = "".join(p["text"] for p in parts)
    return results + ([{"role": "user", "content": text}] if parts or not results else [])


def _image_source(value: Any, where: str) -> ImageInput:
    """An image block's source: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}."""
    body = Body(value, where)
    kind = check_choice(body.string("type", required=True), ("base64", "url"), f"{where}.type")
    if kind == "url":
        image = from_url(body.string("url", required=True), f"{where}.url")
    else:
        media = body.string("media_type", required=True)
        check_choice(media, ("image/jpeg", "image/png", "image/gif", "image/webp"), f"{where}.media_type")
        image = from_base64(body.string("data", required=True), f"{where}.data")
    body.finish()
    return image


def _result_content(value: Any, where: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    blocks = array_field(value, f"{where}.content")
    return "".join(_text_block(b, f"{where}.content[{i}]") for i, b in enumerate(blocks))


def _assistant_blocks(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn: text as content, tool_use blocks as tool_calls, thinking as reasoning_content."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for i, data in enumerate(blocks):
        block_where = f"{where}.content[{i}]"
        kind, body = _block(data, block_where, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            message["content"] += body.string("text", required=True)
            body.raw("citations")
        elif kind == "tool_use":
            call_id, name = body.string("id", required=True), body.string("name", required=True)
            arguments = body.raw("input")
            if not isinstance(arguments, dict):
                raise bad_request(f"{block_where}.input must be an object", f"{block_where}.input")
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            message.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": function})
        elif kind == "thinking":
            message["reasoning_content"] = body.string("thinking", required=True)
            body.string("signature")
        else:
            body.string("data")
        body.finish()
    return message


# ---- tools, tool_choice, thinking ---------------------------------------------------------


def _tool(data: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    body = Body(data, where)
    kind = body.string("type", default="custom")
    if kind != "custom":
        raise bad_request(f"{where}.type {kind!r} is not supported; this server runs custom tools", f"{where}.type")
    function = read_function(body, where, schema_field="input_schema", schema_required=True)
    body.raw("cache_control")
    body.finish()
    return {"type": "function", "function": function}


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str | dict[str, Any], bool]:
    """(chat tool_choice, parallel_tool_calls)."""
    if value is None:
        return ("auto" if tools else "none"), True
    body = Body(value, "tool_choice")
    kind = body.string("type", required=True)
    parallel = not body.boolean("disable_parallel_tool_use")
    name = body.string("name", required=kind == "tool") if kind == "tool" else None
    body.finish()
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(f"tool_choice.type {kind!r} is not auto, any, tool or none", "tool_choice")
    if kind != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if kind == "tool":
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _thinking(value: Any) -> dict[str, Any]:
    """`thinking` {"type": "enabled" | "disabled"} turns a reasoning model's thinking on or off."""
    if value is None:
        return {}
    body = Body(value, "thinking")
    kind = body.string("type", required=True)
    budget = body.integer("budget_tokens", low=1)
    body.finish()
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"thinking.type {kind!r} is not enabled or disabled", "thinking")
    if kind == "enabled" and budget is None:
        raise bad_request("thinking.budget_tokens is required when thinking is enabled", "thinking")
    return {"enable_thinking": kind != "disabled"}


def _output_format(value: Any) -> dict[str, Any] | None:
    """`output_config`: its `format` (a JSON schema) as chat's response_format; `effort` is accepted and ignored."""
    if value is None:
        return None
    body = Body(value, "output_config")
    body.string("effort")
    fmt = body.raw("format")
    body.finish()
    if fmt is None:
        return None
    spec = Body(fmt, "output_config.format")
    if spec.string("type", required=True) != "json_schema":
        raise bad_request("output_config.format.type must be 'json_schema'", "output_config")
    schema = spec.raw("schema")
    if not isinstance(schema, dict):
        raise bad_request("output_config.format.schema must be a JSON Schema object", "output_config")
    spec.finish()
    return {"type": "json_schema", "name": "output", "schema": schema}
