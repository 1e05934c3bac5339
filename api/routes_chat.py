"""POST /v1/chat/completions: messages through the chat template, answers as OpenAI sends them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api import grammar, tools
from baselm.api.errors import bad_request
from baselm.api.generate import (
    Job,
    ServerState,
    Usage,
    check_model,
    check_prompt,
    finish_reason,
    make_params,
    outputs,
    read_json,
    split_copies,
    submit,
    token_text,
    unless_disconnected,
)
from baselm.api.schemas import ChatRequest, parse_chat
from baselm.api.sse import DONE, EventStream, error_event, event
from baselm.engine import CompletionOutput
from baselm.sampling import SamplingParams, TokenLogprobs
from baselm.tokenizer.errors import ChatTemplateError


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.base
    chat = parse_chat(await read_json(request, state.max_body_bytes))
    check_model(state, chat.common.model)
    # Templates, tokenizing and grammar compiling can take a while: off the event loop.
    jobs = await asyncio.to_thread(_prepare, state, chat)
    started = await submit(state, jobs, "messages")
    response = _Response(state, chat, state.tool_format if _parses_tools(chat) else None)
    if chat.common.stream:
        return EventStream(response.stream(outputs(state, started, response.usage)))
    return JSONResponse(await unless_disconnected(request, response.collect(outputs(state, started, response.usage))))


def _prepare(state: ServerState, chat: ChatRequest) -> list[Job]:
    """The engine requests for a checked chat request: prompt ids and SamplingParams per job."""
    prompt_ids = _prompt_ids(state, chat)
    check_prompt(state, prompt_ids, "messages", chat.common.sampling["max_tokens"], chat.common.max_tokens_field)
    return split_copies(prompt_ids, _params_factory(state, chat))


def _parses_tools(chat: ChatRequest) -> bool:
    return bool(chat.tools) and chat.tool_choice != "none"


def _prompt_ids(state: ServerState, chat: ChatRequest) -> list[int]:
    tool_list = chat.tools if _parses_tools(chat) else None
    try:
        return state.tokenizer.encode_chat(chat.messages, add_generation_prompt=True, tools=tool_list)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _grammar(state: ServerState, chat: ChatRequest) -> tuple[str, str] | None:
    """(grammar, the field it enforces) when the answer's shape is constrained."""
    if chat.response_format is not None:
        schema = chat.response_format.get("schema") if chat.response_format["type"] == "json_schema" else None
        return grammar.json_schema_grammar(schema), "response_format"
    if chat.tool_choice == "required" or chat.named_tool:
        # A named function is called once; "required" may call several when parallel_tool_calls allows.
        parallel = chat.parallel_tool_calls and chat.named_tool is None
        lark = tools.forced_call_lark(chat.tools, state.tool_format, chat.named_tool, parallel)
        return grammar.lark_grammar(lark), "tools"
    return None


def _params_factory(state: ServerState, chat: ChatRequest):
    """A maker of SamplingParams: each call gets a fresh grammar processor when one is needed."""
    sampling = dict(chat.common.sampling)
    logprobs = chat.top_logprobs if chat.logprobs else None
    constrained = _grammar(state, chat)
    if constrained is None:
        params = make_params(sampling, chat.common.max_tokens_field, logprobs=logprobs)
        return lambda: params
    text, param = constrained
    for name in ("min_tokens", "ignore_eos"):  # both would keep a finished grammar from ending the answer
        if sampling[name]:
            raise bad_request(
                f"{name} cannot be combined with {param} (the grammar decides where the answer ends)", name
            )
    lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    grammar.check_grammar(text, lltokenizer, param)
    eos = state.eos_token_ids

    def make() -> SamplingParams:
        processor = grammar.GrammarProcessor(lltokenizer, text, eos)
        return make_params(
            sampling, chat.common.max_tokens_field, logprobs=logprobs, logits_processors=[processor], stop_token_ids=eos
        )

    return make


def logprobs_content(state: ServerState, entries: list[TokenLogprobs], num_top: int) -> list[dict[str, Any]]:
    tokenizer = state.tokenizer

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top[:num_top]]} for e in entries]


class _Response:
    """Builds the answer, streamed or whole, from engine outputs; one tool parser per choice."""

    def __init__(self, state: ServerState, chat: ChatRequest, fmt: str | None) -> None:
        self.state = state
        self.chat = chat
        self.fmt = fmt
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = Usage()
        self.parsers: dict[int, tools.ToolCallParser] = {}
        self.num_calls: dict[int, int] = {}

    def _pieces(self, out: CompletionOutput) -> tuple[str, list[tools.ToolCall]]:
        """Content and completed calls this output adds to its choice."""
        if self.fmt is None:
            return out.text, []
        parser = self.parsers.setdefault(out.index, tools.ToolCallParser(self.fmt))
        content, calls = parser.feed(out.text)
        if out.finished:
            more, more_calls = parser.finish()
            content, calls = content + more, calls + more_calls
        self.num_calls[out.index] = len(parser.calls)
        return content, calls

    def _finish_reason(self, out: CompletionOutput) -> str:
        reason = finish_reason(out)
        return "tool_calls" if reason == "stop" and self.num_calls.get(out.index) else reason

    def _logprobs(self, out: CompletionOutput) -> dict[str, Any] | None:
        if not self.chat.logprobs:
            return None
        return {"content": logprobs_content(self.state, out.logprobs, self.chat.top_logprobs), "refusal": None}

    # ---- whole --------------------------------------------------------------------------

    async def collect(self, stream: AsyncIterator[CompletionOutput]) -> dict[str, Any]:
        n = self.chat.common.n
        content = [""] * n
        calls: list[list[tools.ToolCall]] = [[] for _ in range(n)]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        reasons: list[str] = ["stop"] * n
        async for out in stream:
            text, new_calls = self._pieces(out)
            content[out.index] += text
            calls[out.index] += new_calls
            if self.chat.logprobs:
                logprobs[out.index] += logprobs_content(self.state, out.logprobs, self.chat.top_logprobs)
            if out.finished:
                reasons[out.index] = self._finish_reason(out)
        choices = []
        for i in range(n):
            message: dict[str, Any] = {"role": "assistant", "content": content[i] or (None if calls[i] else "")}
            if calls[i]:
                message["tool_calls"] = [c.as_dict() for c in calls[i]]
            lp = {"content": logprobs[i], "refusal": None} if self.chat.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reasons[i]})
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage.as_dict(),
        }

    # ---- streamed -----------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.chat.common.include_usage:
            payload["usage"] = usage
        return event(payload)

    def _choice(
        self, index: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    async def stream(self, stream: AsyncIterator[CompletionOutput]) -> AsyncIterator[str]:
        try:
            for i in range(self.chat.common.n):
                yield self._chunk([self._choice(i, {"role": "assistant", "content": ""})])
            async for out in stream:
                for chunk in self._out_chunks(out):
                    yield chunk
            if self.chat.common.include_usage:
                yield self._chunk([], self.usage.as_dict())
        except Exception as exc:
            yield error_event(exc)
        finally:
            await stream.aclose()
        yield DONE

    def _out_chunks(self, out: CompletionOutput) -> list[str]:
        text, calls = self._pieces(out)
        chunks = []
        logprobs = self._logprobs(out) if out.logprobs else None
        if text or logprobs:
            chunks.append(self._chunk([self._choice(out.index, {"content": text}, logprobs)]))
        for call in calls:
            head = {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            tail = {"index": call.index, "function": {"arguments": call.arguments}}
            chunks.append(self._chunk([self._choice(out.index, {"tool_calls": [head]})]))
            chunks.append(self._chunk([self._choice(out.index, {"tool_calls": [tail]})]))
        if out.finished:
            chunks.append(self._chunk([self._choice(out.index, {}, None, self._finish_reason(out))]))
        return chunks
