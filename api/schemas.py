"""Request bodies of the OpenAI API, checked field by field with plain code.

Each field is either honoured or refused with a 400 that names it; nothing is silently
ignored. Unknown fields are refused too, except `user`, which is purely informational
(OpenAI uses it for abuse tracking) and is accepted and ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from baselm.api.errors import bad_request

INFORMATIONAL_FIELDS = frozenset({"user"})
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ROLES = ("system", "developer", "user", "assistant", "tool")


class Body:
    """A JSON object being read: typed getters that raise 400s naming the field, then `finish`."""

    def __init__(self, data: Any, where: str = "the request body") -> None:
        if not isinstance(data, dict):
            raise bad_request(f"{where} must be a JSON object")
        self.data = data
        self.where = where
        self._read: set[str] = set(INFORMATIONAL_FIELDS) if where == "the request body" else set()

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        self._read.add(name)
        return self.data.get(name)

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.raw(name)
        if value is None:
            if required:
                raise bad_request(f"{name} is required", name)
            return default
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {_kind(value)}", name)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false, got {_kind(value)}", name)
        return value

    def integer(
        self, name: str, low: int | None = None, high: int | None = None, default: int | None = None
    ) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer, got {_kind(value)}", name)
        _check_range(name, value, low, high)
        return value

    def number(
        self, name: str, low: float | None = None, high: float | None = None, default: float | None = None
    ) -> float | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"{name} must be a number, got {_kind(value)}", name)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number", name)
        _check_range(name, value, low, high)
        return float(value)

    def finish(self) -> None:
        """Refuses the fields nobody read: an unknown field is a mistake worth telling."""
        unknown = sorted(k for k in self.data if k not in self._read)
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise bad_request(f"unknown field{'s' if len(unknown) > 1 else ''} {names} in {self.where}", unknown[0])


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise bad_request(f"{name} must be at least {low}, got {value}", name)
    if high is not None and value > high:
        raise bad_request(f"{name} must be at most {high}, got {value}", name)


# ---- shared sampling fields ---------------------------------------------------------------


@dataclass(slots=True)
class Common:
    """Fields chat and completions share."""

    model: str
    stream: bool
    include_usage: bool
    n: int
    sampling: dict[str, Any]  # keyword arguments for SamplingParams
    max_tokens_field: str = "max_tokens"


def read_common(body: Body, default_max_tokens: int | None) -> Common:
    """Reads the shared fields' types; SamplingParams checks the sampling ranges (see make_params)."""
    model = body.string("model", required=True)
    stream = body.boolean("stream")
    include_usage = _stream_options(body, stream)
    n = body.integer("n", default=1)
    sampling: dict[str, Any] = {"n": n}
    for name, default in (("temperature", 1.0), ("top_p", 1.0)):
        sampling[name] = body.number(name, default=default)
    for name in ("presence_penalty", "frequency_penalty"):
        sampling[name] = body.number(name, default=0.0)
    sampling["seed"] = body.integer("seed")
    sampling["stop"] = _stop(body)
    sampling["logit_bias"] = _logit_bias(body)
    sampling["top_k"] = body.integer("top_k", default=0)
    sampling["min_p"] = body.number("min_p", default=0.0)
    sampling["repetition_penalty"] = body.number("repetition_penalty", default=1.0)
    sampling["min_tokens"] = body.integer("min_tokens", default=0)
    sampling["ignore_eos"] = body.boolean("ignore_eos")
    max_field = "max_tokens"
    max_tokens = body.integer("max_tokens")
    if body.has("max_completion_tokens"):
        if max_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_tokens, max_field = body.integer("max_completion_tokens"), "max_completion_tokens"
    sampling["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    return Common(model, stream, include_usage, n, sampling, max_field)


def _stream_options(body: Body, stream: bool) -> bool:
    options = body.raw("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    sub = Body(options, "stream_options")
    include = sub.boolean("include_usage")
    sub.finish()
    return include


def _stop(body: Body) -> list[str]:
    stop = body.raw("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or an array of strings", "stop")
    return stop


def _logit_bias(body: Body) -> dict[int, float] | None:
    bias = body.raw("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"logit_bias value for token {key} must be a number", "logit_bias")
        out[int(key)] = float(value)
    return out


# ---- chat ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    common: Common
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


def parse_chat(data: Any) -> ChatRequest:
    body = Body(data)
    common = read_common(body, default_max_tokens=None)
    messages = [read_message(m, i) for i, m in enumerate(array_field(body.raw("messages"), "messages", required=True))]
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    logprobs = body.boolean("logprobs")
    top_logprobs = body.integer("top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    request = ChatRequest(common, messages, logprobs, top_logprobs or 0)
    request.response_format = _response_format(body.raw("response_format"))
    request.tools = [_tool(t, i) for i, t in enumerate(array_field(body.raw("tools"), "tools"))]
    request.tool_choice = _tool_choice(body.raw("tool_choice"), request.tools)
    request.parallel_tool_calls = body.boolean("parallel_tool_calls", default=True)
    if request.response_format and request.tool_choice not in ("auto", "none"):
        raise bad_request("response_format cannot be combined with a tool_choice that forces a call", "response_format")
    body.finish()
    return request


def array_field(value: Any, name: str, required: bool = False) -> list[Any]:
    if value is None:
        if required:
            raise bad_request(f"{name} is required", name)
        return []
    if not isinstance(value, list):
        raise bad_request(f"{name} must be an array, got {_kind(value)}", name)
    return value


def read_message(data: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    body = Body(data, where)
    role = body.string("role", required=True)
    if role not in _ROLES:
        raise bad_request(f"{where}.role {role!r} is not one of {', '.join(_ROLES)}", f"{where}.role")
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = body.raw("content")
    if content is None and not (role == "assistant" and body.has("tool_calls")):
        raise bad_request(f"{where}.content is required", f"{where}.content")
    if content is not None:
        message["content"] = _content(content, where)
    name = body.string("name")
    if name is not None:
        message["name"] = name
    if role == "tool":
        message["tool_call_id"] = body.string("tool_call_id", required=True)
    if role == "assistant":
        calls = array_field(body.raw("tool_calls"), f"{where}.tool_calls")
        if calls:
            message["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
        if body.raw("refusal") is not None:
            raise bad_request(f"{where}.refusal is not supported; put the text in content", f"{where}.refusal")
    body.finish()
    return message


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        part_where = f"{where}.content[{i}]"
        body = Body(part, part_where)
        kind = body.string("type", required=True)
        if kind != "text":
            raise bad_request(
                f"{part_where} has type {kind!r}; this server reads text parts only (no images, audio or files)",
                f"{part_where}.type",
            )
        parts.append({"type": "text", "text": body.string("text", required=True)})
        body.finish()
    return parts


def _history_call(data: Any, where: str) -> dict[str, Any]:
    body = Body(data, where)
    call_id = body.string("id", required=True)
    if body.string("type", default="function") != "function":
        raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
    function = Body(body.raw("function"), f"{where}.function")
    name = function.string("name", required=True)
    arguments = function.string("arguments", required=True)
    function.finish()
    body.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(data: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    body = Body(data, where)
    if body.string("type", required=True) != "function":
        raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
    fn = Body(body.raw("function"), f"{where}.function")
    name = fn.string("name", required=True)
    if not _FUNCTION_NAME.match(name):
        raise bad_request(
            f"{where}.function.name {name!r} must be 1-64 letters, digits, _ . or -", f"{where}.function.name"
        )
    function: dict[str, Any] = {"name": name}
    description = fn.string("description")
    if description is not None:
        function["description"] = description
    parameters = fn.raw("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    fn.boolean("strict")  # arguments follow the schema whenever a call is forced; see tools.py
    fn.finish()
    body.finish()
    return {"type": "function", "function": function}


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
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    body = Body(value, "response_format")
    kind = body.string("type", required=True)
    if kind == "text":
        body.finish()
        return None
    if kind == "json_object":
        body.finish()
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"response_format.type {kind!r} is not text, json_object or json_schema", "response_format")
    spec = Body(body.raw("json_schema"), "response_format.json_schema")
    name = spec.string("name", required=True)
    spec.string("description")
    schema = spec.raw("schema")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    spec.boolean("strict")  # the output always follows the schema (grammar-constrained decoding)
    spec.finish()
    body.finish()
    return {"type": "json_schema", "name": name, "schema": schema if schema is not None else {}}


# ---- completions --------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionRequest:
    common: Common
    prompts: list[str | list[int]]
    logprobs: int | None = None
    echo: bool = False


def parse_completion(data: Any) -> CompletionRequest:
    body = Body(data)
    common = read_common(body, default_max_tokens=16)  # OpenAI's default for completions
    prompts = _prompts(body.raw("prompt"))
    logprobs = body.integer("logprobs")
    echo = body.boolean("echo")
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs would need prompt logprobs, which this server does not compute", "echo")
    if body.raw("suffix") is not None:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    best_of = body.integer("best_of", low=1)
    if best_of is not None and best_of != common.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    body.finish()
    return CompletionRequest(common, prompts, logprobs, echo)


def _prompts(value: Any) -> list[str | list[int]]:
    if value is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request("prompt must be a string, an array of strings, token ids, or arrays of token ids", "prompt")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if _is_token_ids(value):
        return [list(value)]
    if all(isinstance(p, list) and p and _is_token_ids(p) for p in value):
        return [list(p) for p in value]
    raise bad_request("prompt must be a string, an array of strings, token ids, or arrays of token ids", "prompt")


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
