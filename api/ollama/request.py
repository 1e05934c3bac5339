"""Reading Ollama's request bodies: model names, `options` as sampling parameters, messages, tools, format.

Ollama's documented defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0, repeat_penalty 1.1)
apply where a request leaves a value out and neither the command line nor the model sets one
(baselm/sampling/defaults.py orders them), since Ollama clients rely on them. `num_predict` left
out or negative (Ollama's "no limit") gets the server's token cap. Options that tune
Ollama's own runner (GPU layers, threads, mmap, context size, ...) are accepted and left to this
engine's settings; an unknown option, or a known one of the wrong type, is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from baselm.api.chat import read_tool
from baselm.api.errors import bad_request
from baselm.api.images import ImageInput, from_base64, image_part
from baselm.api.keep_alive import parse_keep_alive
from baselm.api.pool import NOT_GIVEN, pool_of
from baselm.api.schemas import Body, array_field, check_choice
from baselm.api.serving import read_json
from baselm.api.state import ModelState, ServerState
from baselm.sampling.defaults import SAMPLING_NAMES, SamplingDefaults

OLLAMA_DEFAULTS = SamplingDefaults(temperature=0.8, top_p=0.9, top_k=40, min_p=0.0, repetition_penalty=1.1)
# option -> SamplingParams field, for options read as numbers
_NUMBER_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_INT_OPTIONS = {"top_k": "top_k", "seed": "seed"}
# Read for their type, then left to the engine's own settings.
_IGNORED_OPTIONS = frozenset(
    {
        "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "repeat_last_n", "typical_p",
        "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline", "numa", "use_mmap",
        "use_mlock", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only",
    }
)  # fmt: skip
_ROLES = ("system", "user", "assistant", "tool")


async def read_body(request: Request) -> tuple[ModelState, Body]:
    """A route's opening: the body, and the model it names (Ollama's names: `:latest` implied), loaded
    and leased for the request with the body's `keep_alive` (pool.py)."""
    server, body = await read_plain(request)
    return await model_for(request, server, body), body


async def read_plain(request: Request) -> tuple[ServerState, Body]:
    """The server's state and the body, its model not yet looked up."""
    server: ServerState = request.app.state.base
    return server, Body(await read_json(request, server))


def model_field(body: Body, *names: str) -> str:
    """The model a body names (in `model`, or Ollama's older `name`); a 400 when it names none."""
    for name in names or ("model",):
        value = body.string(name)
        if value:
            return value
    raise bad_request("model is required", "model")


def keep_alive_field(body: Body) -> float | str | None:
    """The body's `keep_alive` in seconds (None: for ever), or NOT_GIVEN when it sets none."""
    value = body.raw("keep_alive")
    return NOT_GIVEN if value is None else parse_keep_alive(value)


async def model_for(request: Request, server: ServerState, body: Body) -> ModelState:
    """The model `body` names, under a lease that keeps it loaded to the request's end."""
    name = model_field(body)
    return await pool_of(request).acquire(request.scope, name, keep_alive_field(body))


def sampling_from_options(body: Body) -> dict[str, Any]:
    """SamplingParams keyword arguments from the `options` object (its ranges checked by SamplingParams)."""
    options = Body(body.raw("options") if body.raw("options") is not None else {}, "options")
    sampling: dict[str, Any] = {"n": 1, "logit_bias": None, "min_tokens": 0, "ignore_eos": False}
    for option, name in _NUMBER_OPTIONS.items():
        sampling[name] = options.number(option, default=None if name in SAMPLING_NAMES else 0.0)
    for option, name in _INT_OPTIONS.items():
        sampling[name] = options.integer(option)
    if sampling["top_k"] is not None:
        sampling["top_k"] = max(sampling["top_k"], 0)
    if sampling["seed"] is not None and sampling["seed"] < 0:
        sampling["seed"] = None  # Ollama's -1: a random seed
    num_predict = options.integer("num_predict")
    sampling["max_tokens"] = None if num_predict is None or num_predict < 0 else num_predict
    stop = options.raw("stop")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("options.stop must be an array of strings", "options.stop")
    sampling["stop"] = stop or []
    for name in _IGNORED_OPTIONS:
        options.raw(name)
    options.finish()
    return sampling


def read_format(value: Any) -> dict[str, Any] | None:
    """`format`: "json" (any JSON object) or a JSON Schema; None when absent or empty."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "schema": value}
    raise bad_request('format must be "json" or a JSON Schema object', "format")


def read_images(body: Body, field: str = "images") -> list[ImageInput]:
    """`images`: a list of base64-encoded images (Ollama's shape), for the chat core (images.py)."""
    items = array_field(body.raw("images"), field)
    return [from_base64(item, f"{field}[{i}]") for i, item in enumerate(items)]


def read_messages(body: Body) -> list[dict[str, Any]]:
    """`messages` as the chat template takes them; tool calls' arguments become JSON text."""
    return [_message(m, i) for i, m in enumerate(array_field(body.raw("messages"), "messages"))]


def _message(data: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    body = Body(data, where)
    role = check_choice(body.string("role", required=True), _ROLES, f"{where}.role")
    message: dict[str, Any] = {"role": role, "content": body.string("content", default="")}
    images = read_images(body, f"{where}.images")
    if images:  # Ollama puts a message's images before its text
        message["content"] = [*map(image_part, images), {"type": "text", "text": message["content"]}]
    body.string("thinking")  # earlier thinking is not shown to the model again, as Ollama does
    name = body.string("tool_name")
    if role == "tool" and name is not None:
        message["name"] = name
    calls = array_field(body.raw("tool_calls"), f"{where}.tool_calls")
    if calls:
        if role != "assistant":
            raise bad_request(f"{where}.tool_calls: only assistant messages carry calls", f"{where}.tool_calls")
        message["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{i}]", i) for i, c in enumerate(calls)]
    body.finish()
    return message


def _history_call(data: Any, where: str, index: int) -> dict[str, Any]:
    body = Body(data, where)
    fn = Body(body.raw("function"), f"{where}.function")
    name = fn.string("name", required=True)
    arguments = fn.raw("arguments")
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict) or arguments is None:
        text = json.dumps(arguments or {}, ensure_ascii=False)
    else:
        raise bad_request(f"{where}.function.arguments must be an object", f"{where}.function.arguments")
    fn.integer("index")
    fn.finish()
    call_id = body.string("id") or f"call_{index}"
    body.string("type")
    body.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def read_tools(body: Body) -> list[dict[str, Any]]:
    """`tools`, as OpenAI writes them (Ollama's format), read as chat completions reads them;
    Ollama lets `type` default to function."""
    items = array_field(body.raw("tools"), "tools")
    return [read_tool({"type": "function", **t} if isinstance(t, dict) else t, i) for i, t in enumerate(items)]
