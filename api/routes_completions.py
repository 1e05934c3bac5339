"""POST /v1/completions: plain prompts (text or token ids), continued as OpenAI's legacy API does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
    submit,
    token_text,
    unless_disconnected,
)
from baselm.api.schemas import CompletionRequest, parse_completion
from baselm.api.sse import DONE, EventStream, error_event, event
from baselm.request import RequestOutput
from baselm.sampling import TokenLogprobs


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.base
    req = parse_completion(await read_json(request, state.max_body_bytes))
    check_model(state, req.common.model)
    prompt_ids = await asyncio.to_thread(_encode, state, req.prompts)
    for ids in prompt_ids:
        check_prompt(state, ids, "prompt", req.common.sampling["max_tokens"], "max_tokens")
    params = make_params(req.common.sampling, "max_tokens", logprobs=req.logprobs)
    jobs = [Job(ids, params, i * params.n, i) for i, ids in enumerate(prompt_ids)]
    started = await submit(state, jobs, "prompt")
    response = _Response(state, req, prompt_ids)
    if req.common.stream:
        return EventStream(response.stream(outputs(state, started, response.usage)))
    return JSONResponse(await unless_disconnected(request, response.collect(outputs(state, started, response.usage))))


def _encode(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    return [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


class _Logprobs:
    """OpenAI's completions logprobs: tokens, their logprobs, top alternatives, text offsets."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, state: ServerState, entries: list[TokenLogprobs], offset: int) -> int:
        """Appends `entries`, the first starting at character `offset`; returns the offset after them."""
        for e in entries:
            text = token_text(state.tokenizer, e.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(e.logprob)
            top: dict[str, float] = {}
            for token_id, logprob in e.top:  # best first: two ids that print alike keep the better
                top.setdefault(token_text(state.tokenizer, token_id), logprob)
            self.top_logprobs.append(top)
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class _Response:
    def __init__(self, state: ServerState, req: CompletionRequest, prompt_ids: list[list[int]]) -> None:
        self.state = state
        self.req = req
        self.prompt_ids = prompt_ids
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = Usage()
        self.num_choices = len(prompt_ids) * req.common.n
        self.offsets = [0] * self.num_choices  # characters sent per choice (for text_offset)

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[index // self.req.common.n]
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(prompt)

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        lp = _Logprobs()
        self.offsets[out.index] = lp.add(self.state, out.logprobs, self.offsets[out.index])
        return lp.as_dict()

    async def collect(self, stream: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        texts = [self._echo(i) for i in range(self.num_choices)]
        logprobs = [_Logprobs() for _ in range(self.num_choices)]
        reasons = ["stop"] * self.num_choices
        async for out in stream:
            texts[out.index] += out.text
            if self.req.logprobs is not None:
                self.offsets[out.index] = logprobs[out.index].add(self.state, out.logprobs, self.offsets[out.index])
            if out.finished:
                reasons[out.index] = finish_reason(out)
        choices = [
            {
                "index": i,
                "text": texts[i],
                "logprobs": logprobs[i].as_dict() if self.req.logprobs is not None else None,
                "finish_reason": reasons[i],
            }
            for i in range(self.num_choices)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage.as_dict(),
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.req.common.include_usage:
            payload["usage"] = usage
        return event(payload)

    async def stream(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        try:
            for i in range(self.num_choices):
                if self.req.echo:
                    yield self._chunk([{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}])
            async for out in stream:
                reason = finish_reason(out) if out.finished else None
                logprobs = self._logprobs(out)
                if out.text or logprobs or reason:
                    yield self._chunk(
                        [{"index": out.index, "text": out.text, "logprobs": logprobs, "finish_reason": reason}]
                    )
            if self.req.common.include_usage:
                yield self._chunk([], self.usage.as_dict())
        except Exception as exc:
            yield error_event(exc)
        finally:
            await stream.aclose()
        yield DONE
