"""Ollama's chat and generate: POST /api/chat and POST /api/generate.

/api/chat reads its body into the chat core's request (api/chat.py) and runs it there;
/api/generate builds its prompt from `prompt`, `system` and `context` (or takes it `raw`).
Answers stream as NDJSON (one JSON object a line) unless `stream` is false, then come whole;
the last object has `done: true`, the counts and the durations (nanoseconds), as Ollama sends
them. Errors are `{"error": "..."}` (see errors.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api import serving
from baselm.api.answer_text import AnswerText, Pieces
from baselm.api.chat import ChatRequest, parses_tools, prepare
from baselm.api.constrained import constrained_params
from baselm.api.errors import APIError, bad_request, logger
from baselm.api.images import ImageInput, encode_messages, image_part
from baselm.api.ollama.lines import line, now_rfc3339
from baselm.api.ollama.request import (
    OLLAMA_DEFAULTS,
    keep_alive_field,
    model_field,
    model_for,
    read_format,
    read_images,
    read_messages,
    read_plain,
    read_tools,
    sampling_from_options,
)
from baselm.api.pool import pool_of
from baselm.api.schemas import Body, Common
from baselm.api.state import ModelState, ServerState
from baselm.request import RequestOutput
from baselm.sampling.params import SamplingParams
from baselm.structured import grammar
from baselm.tokenizer.errors import ChatTemplateError
from baselm.toolcalls import parsers
from baselm.vision import PromptImage

MAX_TOKENS_FIELD = "options.num_predict"


def _params(state: ModelState, sampling: dict[str, Any], fmt: dict[str, Any] | None) -> SamplingParams:
    """/api/generate's SamplingParams; `format` is enforced by a grammar."""
    if fmt is None:
        return serving.make_params(sampling, MAX_TOKENS_FIELD)
    text = grammar.json_schema_grammar(fmt.get("schema"))
    return constrained_params(state, sampling, MAX_TOKENS_FIELD, text, "format")


class _OllamaAnswer(serving.Answer):
    """One Ollama answer: NDJSON lines of text deltas, then a `done` line with counts and durations."""

    id_prefix = "ollama-"
    media_type = "application/x-ndjson"
    text_field: ClassVar[str]  # "message" (chat) or "response" (generate)

    def __init__(
        self,
        state: ModelState,
        common: Common,
        prompt_ids: list[int],
        tool_fmt: str | None,
        split: bool,
        tool_list: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(state, common, 1)
        # A reasoning model's thinking goes apart (`thinking`), then tool calls; raw prompts stay raw.
        texts = AnswerText.for_prompt(state, prompt_ids, tool_fmt, tool_list or ()) if split else AnswerText(None, None)
        self.split = texts
        self.prompt_ids = prompt_ids
        self.whole_pieces = Pieces()
        self.output_ids: list[int] = []
        self.done_reason = "stop"
        self.started = time.perf_counter_ns()
        self.first_token: int | None = None

    def _pieces(self, out: RequestOutput) -> Pieces:
        if out.token_ids and self.first_token is None:
            self.first_token = time.perf_counter_ns()
        self.output_ids += out.token_ids
        if out.finished:
            if out.finish_reason == "abort":
                raise APIError(503, "the server is shutting down; the request was stopped")
            self.done_reason = out.finish_reason or "stop"
        return self.split.feed(out.text, out.finished)

    def _envelope(self, done: bool) -> dict[str, Any]:
        return {"model": self.common.model, "created_at": now_rfc3339(), "done": done}

    def _stats(self) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first_token or end
        return {
            "done_reason": self.done_reason,
            "total_duration": end - self.started,
            "load_duration": 0,
            "prompt_eval_count": sum(self.usage.prompt.values()),
            "prompt_eval_duration": first - self.started,
            "eval_count": sum(self.usage.completion.values()),
            "eval_duration": end - first,
        }

    def payload(self, pieces: Pieces) -> dict[str, Any]:
        """The text-carrying fields of one line."""
        fields: dict[str, Any] = {self.text_field: pieces.content}
        if pieces.reasoning:
            fields["thinking"] = pieces.reasoning
        return fields

    def done_extra(self) -> dict[str, Any]:
        return {}

    def add(self, out: RequestOutput) -> None:
        pieces = self._pieces(out)
        whole = self.whole_pieces
        whole.reasoning += pieces.reasoning
        whole.content += pieces.content
        whole.calls += pieces.calls

    def whole(self) -> dict[str, Any]:
        return {**self._envelope(True), **self.payload(self.whole_pieces), **self._stats(), **self.done_extra()}

    def events(self, out: RequestOutput) -> list[str]:
        pieces = self._pieces(out)
        lines = []
        if pieces.content or pieces.reasoning or pieces.calls:
            lines.append(line({**self._envelope(False), **self.payload(pieces)}))
        if out.finished:
            lines.append(line({**self._envelope(True), **self.payload(Pieces()), **self._stats(), **self.done_extra()}))
        return lines

    def error_events(self, exc: Exception) -> list[str]:
        if not isinstance(exc, APIError):
            logger.exception("internal error while streaming", exc_info=exc)
            exc = APIError(500, "the server hit an internal error while streaming")
        return [line({"error": exc.message})]


class _ChatAnswer(_OllamaAnswer):
    text_field = "message"

    def payload(self, pieces: Pieces) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": pieces.content}
        if pieces.reasoning:
            message["thinking"] = pieces.reasoning
        if pieces.calls:
            message["tool_calls"] = [_ollama_call(c) for c in pieces.calls]
        return {"message": message}


class _GenerateAnswer(_OllamaAnswer):
    text_field = "response"

    def done_extra(self) -> dict[str, Any]:
        return {"context": self.prompt_ids + self.output_ids}


def _ollama_call(call: parsers.ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"id": call.id, "function": {"index": call.index, "name": call.name, "arguments": arguments}}


def _common(body: Body, state: ModelState) -> tuple[Common, dict[str, Any] | None]:
    stream = body.boolean("stream", default=True)
    sampling = state.fill_defaults(sampling_from_options(body), OLLAMA_DEFAULTS)
    fmt = read_format(body.raw("format"))
    return Common(state.model_name, stream, False, 1, sampling, MAX_TOKENS_FIELD, OLLAMA_DEFAULTS), fmt


def _think(body: Body) -> dict[str, Any]:
    """`think` as the template's `enable_thinking` switch (Qwen3 and the like); absent leaves the default."""
    think = body.raw("think")
    if think is None:
        return {}
    if not isinstance(think, (bool, str)):
        raise bad_request("think must be true, false, or an effort level", "think")
    return {"enable_thinking": think is not False}


async def _unload_reply(request: Request, server: ServerState, body: Body, text: dict[str, Any]) -> Response | None:
    """An empty request with `keep_alive` 0 unloads its model (loaded or not) and answers at once,
    as Ollama documents; None for any other request, and for a model the server was started with."""
    if keep_alive_field(body) != 0 or body.raw("messages") or body.raw("prompt") or body.raw("context"):
        return None
    entry = await pool_of(request).lookup(model_field(body))
    if entry.pinned:  # started with the server, it stays: the request is answered as a load
        return None
    for field in body.data:  # an unload reads nothing else
        body.raw(field)
    entry.keep_alive = 0  # in use: it unloads once its requests end
    await pool_of(request).unload(entry)
    reply = {"model": entry.name, "created_at": now_rfc3339(), **text, "done_reason": "unload", "done": True}
    return JSONResponse(reply)


async def ollama_chat(request: Request) -> Response:
    """POST /api/chat; without messages it loads the model (keep_alive 0: unloads it) and answers at once."""
    server, body = await read_plain(request)
    unloaded = await _unload_reply(request, server, body, {"message": {"role": "assistant", "content": ""}})
    if unloaded is not None:
        return unloaded
    state = await model_for(request, server, body)
    messages = read_messages(body)
    tool_list = read_tools(body)
    common, fmt = _common(body, state)
    extra = _think(body)
    body.finish()
    if not messages:  # Ollama loads the model and answers at once
        return JSONResponse({**_ChatAnswer(state, common, [], None, False).whole(), "done_reason": "load"})
    serving.check_writes_text(state)
    chat = ChatRequest(
        common, messages, response_format=fmt, tools=tool_list, chat_template_kwargs=extra, format_field="format"
    )
    jobs = await asyncio.to_thread(prepare, state, chat)
    tool_fmt = state.tool_format if parses_tools(chat) else None
    answer = _ChatAnswer(state, common, jobs[0].prompt_ids, tool_fmt, True, tool_list)
    return await serving.respond(request, state, jobs, "messages", answer)


def _generate_ids(
    state: ModelState, body: Body, extra: dict[str, Any], images: list[ImageInput]
) -> tuple[list[int], list[PromptImage]]:
    """Prompt ids of /api/generate: the prompt (after `images`) through the chat template (unless
    `raw`), after `context`; and the images placed in it."""
    prompt = body.string("prompt", default="")
    system = body.string("system")
    raw = body.boolean("raw")
    context = body.raw("context") or []
    if not isinstance(context, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise bad_request("context must be an array of token ids", "context")
    for name in ("suffix", "template"):
        if body.string(name):
            raise bad_request(f"{name} is not supported; the model's own chat template is used", name)
    if raw:
        if images:
            raise bad_request("a raw prompt takes no images; leave raw off for the chat template to place them", "raw")
        return context + state.tokenizer.encode(prompt, add_special_tokens=not context), []
    content: str | list[dict[str, Any]] = prompt
    if images:  # before the prompt, as in a chat message
        content = [*map(image_part, images), {"type": "text", "text": prompt}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    try:
        ids, prompt_images = encode_messages(state, messages, add_generation_prompt=True, **extra)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "prompt") from None
    bos = state.tokenizer.bos_token_id
    dropped = int(bool(context and ids and ids[0] == bos))  # the context already began with BOS
    shift = len(context) - dropped
    return context + ids[dropped:], [replace(i, positions=i.positions + shift) for i in prompt_images]


def _generate_job(
    state: ModelState,
    body: Body,
    common: Common,
    fmt: dict[str, Any] | None,
    extra: dict[str, Any],
    images: list[ImageInput],
) -> serving.Job:
    """/api/generate's one engine job: its prompt ids and images, checked, and its params (`format`'s
    grammar compiled)."""
    ids, prompt_images = _generate_ids(state, body, extra, images)
    body.finish()
    serving.check_prompt(state, ids, "prompt", common.sampling["max_tokens"], MAX_TOKENS_FIELD)
    return serving.Job(ids, _params(state, common.sampling, fmt), 0, images=prompt_images)


async def ollama_generate(request: Request) -> Response:
    """POST /api/generate; without a prompt it loads the model (keep_alive 0: unloads it) and answers at once."""
    server, body = await read_plain(request)
    unloaded = await _unload_reply(request, server, body, {"response": ""})
    if unloaded is not None:
        return unloaded
    state = await model_for(request, server, body)
    common, fmt = _common(body, state)
    images = read_images(body)
    extra = _think(body)
    if not body.string("prompt") and not body.raw("context"):  # a load request: no prompt at all
        for name in ("system", "raw", "suffix", "template", "context"):
            body.raw(name)
        body.finish()
        return JSONResponse({**_GenerateAnswer(state, common, [], None, False).whole(), "done_reason": "load"})
    serving.check_writes_text(state)
    job = await asyncio.to_thread(_generate_job, state, body, common, fmt, extra, images)  # a format grammar compiles
    answer = _GenerateAnswer(state, common, job.prompt_ids, None, not body.data.get("raw"))
    return await serving.respond(request, state, [job], "prompt", answer)
