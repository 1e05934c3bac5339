"""POST /v1/completions: plain prompts (text or token ids), continued as OpenAI's legacy API does.

The route, then what this protocol does on top of the serving core: prompt ids and
SamplingParams per prompt, choices with text and OpenAI's completions logprobs, and its body.

`echo` with `logprobs` also scores the prompt (the engine's prompt logprobs; the first token
has none, as OpenAI shows it), and `max_tokens: 0` with `echo` only scores it: this is how
evaluation harnesses (lm-evaluation-harness) compute a text's likelihood with a server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from baselm.api import serving
from baselm.api.errors import bad_request
from baselm.api.schemas import Body, Common, read_common
from baselm.api.state import ModelState
from baselm.request import RequestOutput
from baselm.sampling.defaults import SamplingDefaults
from baselm.sampling.params import TokenLogprobs

MAX_CHOICES = 256  # prompts × n in one request
COMPLETIONS_DEFAULTS = SamplingDefaults(max_tokens=16)  # OpenAI's, below the command line's and the model's


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    state, req = await serving.read_request(request, parse_completion)
    # Tokenizing can take a while: off the event loop.
    jobs = await asyncio.to_thread(_prepare, state, req)
    answer = _CompletionAnswer(state, req, [job.prompt_ids for job in jobs])
    return await serving.respond(request, state, jobs, "prompt", answer)


def _prepare(state: ModelState, req: CompletionRequest) -> list[serving.Job]:
    """The engine requests: one job for each prompt (the engine makes its n copies). Scoring only
    (max_tokens 0) still draws one token, which the answer leaves out."""
    prompt_ids = [state.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    sampling = {**req.common.sampling, "max_tokens": 1} if req.score_only else req.common.sampling
    for ids in prompt_ids:
        serving.check_prompt(state, ids, "prompt", sampling["max_tokens"], "max_tokens")
    prompt_logprobs = req.logprobs if req.echo else None
    params = serving.make_params(sampling, "max_tokens", logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    return [serving.Job(ids, params, i * params.n, i) for i, ids in enumerate(prompt_ids)]


# ---- the answer ---------------------------------------------------------------------------


class _Logprobs:
    """OpenAI's completions logprobs: tokens, their logprobs, top alternatives, text offsets."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_prompt(self, state: ModelState, prompt_ids: list[int], scored: list[TokenLogprobs]) -> int:
        """The prompt's tokens from offset 0: the first unscored (null), the rest as the engine scored them."""
        text = serving.token_text(state.tokenizer, prompt_ids[0])
        self.tokens.append(text)
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)
        self.text_offset.append(0)
        return self.add(state, scored, len(text))

    def add(self, state: ModelState, entries: list[TokenLogprobs], offset: int) -> int:
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

    def extend(self, later: _Logprobs) -> _Logprobs:
        """These entries followed by `later`'s (whose offsets already count these)."""
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(later, name))
        return self

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

    def __init__(self, state: ModelState, req: CompletionRequest, prompt_ids: list[list[int]]) -> None:
        super().__init__(state, req.common, len(req.prompts) * req.common.n)
        self.req = req
        self.prompt_ids = prompt_ids
        self.scores_prompt = req.echo and req.logprobs is not None
        self.prompt_scores: dict[int, list[TokenLogprobs]] = {}  # prompt index -> its scored tokens
        self.echoes = [self._echo(i) for i in range(self.num_choices)]  # the prompt per choice, "" unless echo
        self.echo_sent = [not req.echo] * self.num_choices  # streamed: has the choice's echo gone out
        self.offsets = [len(echo) for echo in self.echoes]  # characters sent per choice (for text_offset)
        self.texts = list(self.echoes)  # the whole answer, per choice
        self.logprobs = [_Logprobs() for _ in range(self.num_choices)]

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        prompt = self.req.prompts[index // self.req.common.n]
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(prompt)

    def _take(self, out: RequestOutput) -> tuple[str, list[TokenLogprobs]]:
        """The output's text and logprobs for the answer (none when only the prompt is scored);
        keeps the prompt's scores, which the first copy of each prompt brings."""
        prompt_index = out.index // self.req.common.n
        if out.prompt_logprobs:
            self.prompt_scores.setdefault(prompt_index, []).extend(out.prompt_logprobs)
        return ("", []) if self.req.score_only else (out.text, out.logprobs)

    def _prompt_logprobs(self, index: int) -> _Logprobs:
        prompt_index = index // self.req.common.n
        lp = _Logprobs()
        lp.add_prompt(self.state, self.prompt_ids[prompt_index], self.prompt_scores.get(prompt_index, []))
        return lp

    def finish_reason(self, out: RequestOutput) -> str:
        return "length" if self.req.score_only and out.finish_reason != "abort" else super().finish_reason(out)

    def add(self, out: RequestOutput) -> None:
        text, entries = self._take(out)
        self.texts[out.index] += text
        if self.req.logprobs is not None:
            self.offsets[out.index] = self.logprobs[out.index].add(self.state, entries, self.offsets[out.index])
        if out.finished:
            self.finish_reasons[out.index] = self.finish_reason(out)

    def choice(self, index: int) -> dict[str, Any]:
        logprobs = None
        if self.req.logprobs is not None:
            generated = self.logprobs[index]
            if self.scores_prompt:
                generated = self._prompt_logprobs(index).extend(generated)
            logprobs = generated.as_dict()
        return _choice(index, self.texts[index], logprobs, self.finish_reasons[index])

    def whole(self) -> dict[str, Any]:
        body = super().whole()
        if self.req.score_only:
            body["usage"] = self._scoring_usage()
        return body

    def _scoring_usage(self) -> dict[str, Any]:
        usage = self.usage.as_dict()  # the one token drawn per choice is not part of the answer
        usage["total_tokens"] -= usage["completion_tokens"]
        usage["completion_tokens"] = 0
        return usage

    def opening(self) -> list[str]:
        if not self.req.echo or self.scores_prompt:  # a scored echo waits for the prompt's scores
            return []
        self.echo_sent = [True] * self.num_choices
        return [self.chunk([_choice(i, echo)]) for i, echo in enumerate(self.echoes)]

    def events(self, out: RequestOutput) -> list[str]:
        text, entries = self._take(out)
        events = []
        if not self.echo_sent[out.index]:
            self.echo_sent[out.index] = True
            prompt = self._prompt_logprobs(out.index).as_dict()
            events.append(self.chunk([_choice(out.index, self.echoes[out.index], prompt)]))
        reason = self.finish_reason(out) if out.finished else None
        logprobs = None
        if self.req.logprobs is not None:
            lp = _Logprobs()
            self.offsets[out.index] = lp.add(self.state, entries, self.offsets[out.index])
            logprobs = lp.as_dict()
        if text or entries or reason:
            events.append(self.chunk([_choice(out.index, text, logprobs, reason)]))
        return events

    def closing(self) -> list[str]:
        if self.common.include_usage and self.req.score_only:
            return [self.chunk([], self._scoring_usage())]
        return super().closing()


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
    score_only: bool = False  # max_tokens 0 with echo: the prompt, scored, and no answer


def parse_completion(data: Any) -> CompletionRequest:
    """The checked completions body; a 400 naming the first field at fault."""
    body = Body(data)
    common = read_common(body, COMPLETIONS_DEFAULTS)
    prompts = _prompts(body.raw("prompt"), common.n)
    logprobs = body.integer("logprobs")
    echo = body.boolean("echo")
    score_only = common.sampling["max_tokens"] == 0
    if score_only and not echo:
        raise bad_request(
            "max_tokens 0 asks for no answer: set echo to get the prompt (and logprobs its scores)", "max_tokens"
        )
    if body.raw("suffix") is not None:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    best_of = body.integer("best_of", low=1)
    if best_of is not None and best_of != common.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    body.finish()
    return CompletionRequest(common, prompts, logprobs, echo, score_only)


def _prompts(value: Any, n: int) -> list[str | list[int]]:
    if value is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request("prompt must be a string, an array of strings, token ids, or arrays of token ids", "prompt")
    _check_num_choices(len(value) if isinstance(value[0], (str, list)) else 1, n)
    if all(isinstance(p, str) for p in value):
        return list(value)
    if _is_token_ids(value):
        return [list(value)]
    if all(isinstance(p, list) and p and _is_token_ids(p) for p in value):
        return [list(p) for p in value]
    raise bad_request("prompt must be a string, an array of strings, token ids, or arrays of token ids", "prompt")


def _check_num_choices(num_prompts: int, n: int) -> None:
    """A 400 when prompts × n passes MAX_CHOICES: checked before any prompt is copied or tokenized,
    since each choice holds its own text, logprobs and engine request."""
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompts with n {n} ask for {num_prompts * n} choices; a request asks for at most "
            f"{MAX_CHOICES} (prompts × n)",
            "prompt" if num_prompts > MAX_CHOICES else "n",
        )


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
