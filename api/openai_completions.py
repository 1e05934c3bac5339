"""POST /v1/completions: plain prompts (text or token ids), continued as OpenAI's legacy API does.

The route, then what this protocol does on top of the serving core: prompt ids and
SamplingParams per prompt, choices with text and OpenAI's completions logprobs, and its body.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from baselm.api import serving
from baselm.api.errors import bad_request
from baselm.api.schemas import MAX_COMPLETION_LOGPROBS, Body, Common, read_common
from baselm.engine import CompletionOutput
from baselm.sampling import TokenLogprobs


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    state, req = await serving.read_request(request, parse_completion)
    # Tokenizing can take a while: off the event loop.
    jobs = await asyncio.to_thread(_prepare, state, req)
    return await serving.respond(request, state, jobs, "prompt", _CompletionAnswer(state, req))


def _prepare(state: serving.ServerState, req: CompletionRequest) -> list[serving.Job]:
    """The engine requests: one job (or one per copy) for each prompt."""
    prompt_ids = [state.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    for ids in prompt_ids:
        serving.check_prompt(state, ids, "prompt", req.common.sampling["max_tokens"], "max_tokens")
    params = serving.make_params(req.common.sampling, "max_tokens", logprobs=req.logprobs)
    return [job for i, ids in enumerate(prompt_ids) for job in serving.split_copies(ids, lambda: params, i)]


# ---- the answer ---------------------------------------------------------------------------


class _Logprobs:
    """OpenAI's completions logprobs: tokens, their logprobs, top alternatives, text offsets."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, state: serving.ServerState, entries: list[TokenLogprobs], offset: int) -> int:
        """Appends `entries`, the first starting at character `offset`; returns the offset after them."""
        for e in entries:
            text = serving.token_text(state.tokenizer, e.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(e.logprob)
            top: dict[str, float] = {}
            for token_id, logprob in e.top:  # best first: two ids that print alike keep the better
                top.setdefault(serving.token_text(state.tokenizer, token_id), logprob)
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


class _CompletionAnswer(serving.ChoicesAnswer):
    """Completion choices, n per prompt in prompt order: text (after the prompt when echoed) and logprobs."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: serving.ServerState, req: CompletionRequest) -> None:
        super().__init__(state, req.common, len(req.prompts) * req.common.n)
        self.req = req
        self.offsets = [0] * self.num_choices  # characters sent per choice (for text_offset)
        self.echoes = [self._echo(i) for i in range(self.num_choices)]  # the prompt per choice, "" unless echo
        self.texts = list(self.echoes)  # the whole answer, per choice
        self.logprobs = [_Logprobs() for _ in range(self.num_choices)]

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[index // self.req.common.n]
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(prompt)

    def add(self, out: CompletionOutput) -> None:
        self.texts[out.index] += out.text
        if self.req.logprobs is not None:
            self.offsets[out.index] = self.logprobs[out.index].add(self.state, out.logprobs, self.offsets[out.index])
        if out.finished:
            self.finish_reasons[out.index] = self.finish_reason(out)

    def choice(self, index: int) -> dict[str, Any]:
        logprobs = self.logprobs[index].as_dict() if self.req.logprobs is not None else None
        return _choice(index, self.texts[index], logprobs, self.finish_reasons[index])

    def opening(self) -> list[str]:
        return [self.chunk([_choice(i, echo)]) for i, echo in enumerate(self.echoes)] if self.req.echo else []

    def events(self, out: CompletionOutput) -> list[str]:
        reason = self.finish_reason(out) if out.finished else None
        logprobs = None
        if self.req.logprobs is not None:
            lp = _Logprobs()
            self.offsets[out.index] = lp.add(self.state, out.logprobs, self.offsets[out.index])
            logprobs = lp.as_dict()
        if out.text or logprobs or reason:
            return [self.chunk([_choice(out.index, out.text, logprobs, reason)])]
        return []


def _choice(index: int, text: str, logprobs: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


# ---- the request body ---------------------------------------------------------------------


@dataclass(slots=True)
class CompletionRequest:
    """A checked completions request body: each prompt as text or token ids."""

    common: Common
    prompts: list[str | list[int]]
    logprobs: int | None = None
    echo: bool = False


def parse_completion(data: Any) -> CompletionRequest:
    """The checked completions body; a 400 naming the first field at fault."""
    body = Body(data)
    common = read_common(body, default_max_tokens=16)  # OpenAI's default for completions
    prompts = _prompts(body.raw("prompt"))
    logprobs = body.integer("logprobs", low=0, high=MAX_COMPLETION_LOGPROBS)
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
