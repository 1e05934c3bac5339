"""The serving core every protocol module stands on: read a request, submit it, stream or collect its answer.

A protocol module parses its body, builds its prompt ids and SamplingParams (a chat protocol
through the chat core, chat.py; completions itself), and formats its answer; everything else
lives here, in the order a request meets it:

1. `read_request`: the handler's opening: the body read as JSON (size-limited), parsed by the
   protocol, its model found in the pool (loaded if need be, leased for the request; pool.py) as
   the request asks for it (an adapter's name, a `lora` list: state.py), what it leaves out filled
   in from that model's generation defaults (`ModelState.fill_defaults`; auth and request counting
   happened before, in auth.Gate).
2. `make_params`, `check_prompt`: checked fields into engine jobs (one per prompt; the engine
   makes a request's n copies).
3. `respond`: `submit` the jobs to the engine, merge their `outputs` into one stream of
   choices (one engine request per prompt), then the
   protocol's `Answer` streams it as SSE events (sse.py) or collects one JSON body.
   `Answer` is the skeleton any protocol fills in; `ChoicesAnswer` is the envelope and
   chunk OpenAI's chat and completions share.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from baselm.api import request_log, sse
from baselm.api.connections import BodyBudget
from baselm.api.errors import APIError, bad_request
from baselm.api.metrics import ModelMetrics
from baselm.api.pool import pool_of
from baselm.api.request_log import RequestLog
from baselm.api.schemas import Common, check_depth
from baselm.api.state import ModelState, ServerState
from baselm.async_engine import RequestStream
from baselm.engine import QueueFullError
from baselm.memory import note_work
from baselm.models.base import ModelConfigError
from baselm.request import RequestOutput
from baselm.sampling.params import SamplingParams, SamplingParamsError
from baselm.scheduler import RequestTooLongError, effective_max_tokens
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision.prompt import PromptImage

LARGE_BODY_BYTES = 256 * 1024  # a body this large is parsed and rendered into much more, then freed

# ---- the handler's opening ----------------------------------------------------------------


class _Parsed(Protocol):
    """What `read_request` needs of a parsed body: the common fields, its model among them."""

    common: Common


ParsedT = TypeVar("ParsedT", bound=_Parsed)


async def read_request(request: Request, parse: Callable[[Any], ParsedT]) -> tuple[ModelState, ParsedT]:
    """A handler's opening: the body read as JSON and parsed by `parse`, the model it names (loaded,
    under a lease the request holds to its end; pool.py), and the sampling values it leaves out filled in."""
    server: ServerState = request.app.state.base
    parsed = parse(await read_json(request, server))
    state = await pool_of(request).acquire(request.scope, parsed.common.model)
    check_writes_text(state)
    if parsed.common.lora is not None:
        state = state.with_lora(parsed.common.lora)
    parsed.common.sampling = state.fill_defaults(parsed.common.sampling, parsed.common.defaults)
    return state, parsed


def check_writes_text(state: ModelState) -> None:
    """A 400 naming the model when it cannot write text (a reranker with a classification head)."""
    try:
        state.client.engine.loaded.check_writes_text(state.model_name)
    except ModelConfigError as exc:
        raise bad_request(str(exc), "model") from None


async def read_json(request: Request, state: ServerState) -> Any:
    """The body parsed as JSON; 413 past the server's body limit, 408 when it has not all arrived
    within its read timeout (a client trickling bytes holds nothing for long), 503 when the bodies
    being read at once would pass their budget, 400 when it is not JSON or nests too deep."""
    limit = state.max_body_bytes
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > limit:
        raise APIError(413, f"the request body is {length} bytes; the limit is {limit}")
    budget = state.body_budget
    if not budget.take(declared or 0):
        raise _busy_reading(budget)
    try:
        raw = await _read_within(request, state, declared is None)
        if len(raw) >= LARGE_BODY_BYTES:
            note_work()  # its parse and render come and go: the engine's idle release hands them back
        return _parse(raw)
    finally:
        budget.give_back(declared or 0)


def _busy_reading(budget: BodyBudget) -> APIError:
    message = f"the server is reading {budget.num_bytes} bytes of other request bodies; retry shortly"
    return APIError(503, message, headers={"Retry-After": "1", "Connection": "close"})


async def _read_within(request: Request, state: ServerState, counts_chunks: bool) -> bytes:
    """The body, by the read timeout; `counts_chunks` (no Content-Length): each chunk taken from the
    budget as it comes, and given back once the body is whole."""
    try:
        async with asyncio.timeout(state.read_timeout):
            return await _read_body(request, state.max_body_bytes, state.body_budget if counts_chunks else None)
    except TimeoutError:
        message = f"the request body did not arrive within {state.read_timeout:g} seconds"
        raise APIError(408, message, headers={"Connection": "close"}) from None  # the rest of it is not awaited
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection while sending the request") from None


def _parse(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON ({str(exc)[:200]})") from None
    check_depth(data)
    return data


async def _read_body(request: Request, limit: int, budget: BodyBudget | None) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes")
            if budget is not None and not budget.take(len(chunk)):
                raise _busy_reading(budget)
            size += len(chunk)
            chunks.append(chunk)
    finally:
        if budget is not None:
            budget.give_back(size)
    return b"".join(chunks)


def make_params(
    sampling: dict[str, Any], max_tokens_field: str, logprobs_field: str = "logprobs", **extra: Any
) -> SamplingParams:
    """SamplingParams from typed fields; a value out of its range is a 400 naming the request's field."""
    try:
        return SamplingParams(**sampling, **extra)
    except SamplingParamsError as exc:
        param = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(exc.field, exc.field)
        raise bad_request(str(exc), param) from None


def check_prompt(
    state: ModelState, prompt_ids: list[int], prompt_field: str, max_tokens: int | None, max_tokens_field: str
) -> None:
    """Refuses prompts that are empty, hold unknown ids, or leave no room for the answer."""
    if not prompt_ids:
        raise bad_request("the prompt is empty; give it at least one token", prompt_field)
    bad = [t for t in prompt_ids if t >= state.vocab_size]
    if bad:
        raise bad_request(f"prompt token {bad[0]} is outside the vocabulary of {state.vocab_size}", prompt_field)
    try:
        effective_max_tokens(len(prompt_ids), max_tokens, state.max_model_len)
    except RequestTooLongError as exc:
        param = prompt_field if exc.field == "prompt" else max_tokens_field
        raise bad_request(str(exc), param, "context_length_exceeded") from None


@dataclass(slots=True)
class Job:
    """One engine request: its prompt, params, and where its n copies land among the choices."""

    prompt_ids: list[int]
    params: SamplingParams
    index_offset: int
    prompt_index: int = 0  # which prompt of the API request (usage counts each prompt once)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    images: list[PromptImage] = field(default_factory=list)  # the prompt's images (images.py)


@dataclass(slots=True)
class Usage:
    """Token counts of one API request, summed over its engine requests."""

    prompt: dict[int, int] = field(default_factory=dict)  # prompt index -> prompt tokens
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> its most prefix-cache hits
    completion: dict[int, int] = field(default_factory=dict)  # choice index -> output tokens

    def add(self, prompt_index: int, index: int, out: RequestOutput) -> None:
        self.prompt[prompt_index] = out.num_prompt_tokens
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), out.num_cached_tokens)
        self.completion[index] = out.num_output_tokens

    def as_dict(self) -> dict[str, Any]:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


# ---- submitting, then streaming or collecting the answer ----------------------------------


async def respond(request: Request, state: ModelState, jobs: list[Job], prompt_field: str, answer: Answer) -> Response:
    """Submits `jobs`, then answers from their outputs: SSE chunks when streamed, else one JSON body."""
    started = await submit(state, jobs, prompt_field)
    record = request_log.of(request.scope)
    if record is not None:
        record.usage = answer.usage
    merged = outputs(state, started, answer.usage, record)
    if answer.common.stream:
        return sse.EventStream(answer.stream(merged), answer.media_type)
    return JSONResponse(await unless_disconnected(request, answer.collect(merged)))


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Awaits `work` (a whole, non-streamed answer, or embeddings); a client that leaves first cancels
    it, which aborts its engine requests. Streams watch the connection themselves (see sse.py)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection before the answer was ready")
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def submit(state: ModelState, jobs: list[Job], prompt_field: str) -> list[tuple[Job, RequestStream]]:
    """Queues every job on the engine; on a refusal, aborts those already queued and raises an APIError."""
    started: list[tuple[Job, RequestStream]] = []
    try:
        for job in jobs:
            stream = await state.client.submit(
                job.prompt_ids, job.params, job.request_id, images=job.images, adapters=state.adapters
            )
            started.append((job, stream))
    except BaseException as exc:
        for _, stream in started:
            await stream.aclose()  # aborts it
        if isinstance(exc, QueueFullError):
            raise APIError(
                429, f"the server is busy ({exc}); retry shortly", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        if isinstance(exc, RequestTooLongError):
            raise bad_request(str(exc), prompt_field, "context_length_exceeded") from None
        if isinstance(exc, SamplingParamsError):
            raise bad_request(str(exc), exc.field) from None
        if isinstance(exc, ValueError):
            raise bad_request(str(exc)) from None
        raise
    return started


async def outputs(
    state: ModelState, started: list[tuple[Job, RequestStream]], usage: Usage, record: RequestLog | None = None
) -> AsyncIterator[RequestOutput]:
    """The outputs of all jobs as they come, `index` set to the choice index; counts usage and latency,
    and shows each output to the request's log line (`record`).

    Leaving early (a disconnect, an error) aborts every job still running.
    """
    queue: asyncio.Queue = asyncio.Queue()
    arrival = time.monotonic()
    last_seen: dict[int, float] = {}
    pumps = [asyncio.create_task(_pump(job, iterator, queue)) for job, iterator in started]
    done: set[str] = set()  # request ids whose outputs are all in
    try:
        while len(done) < len(started):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            job, out = item
            if out is None:
                done.add(job.request_id)
                continue
            out.index += job.index_offset
            usage.add(job.prompt_index, out.index, out)
            _observe_latency(state.metrics, out, arrival, last_seen)
            if record is not None:
                record.observe(out)
            yield out
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for _, stream in started:  # a pump cancelled before it began never closed its stream
            await stream.aclose()  # aborts it unless it finished
        state.metrics.count_tokens(sum(usage.prompt.values()), sum(usage.completion.values()))


async def _pump(job: Job, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((job, out))
        queue.put_nowait((job, None))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the engine failed this request: hand the error to the reader
        queue.put_nowait(exc)
    finally:
        await stream.aclose()


def _observe_latency(metrics: ModelMetrics, out: RequestOutput, arrival: float, last_seen: dict[int, float]) -> None:
    if not out.token_ids:
        return
    now = time.monotonic()
    if out.index in last_seen:
        metrics.observe_itl(now - last_seen[out.index])
    else:
        metrics.observe_ttft(now - arrival)
    last_seen[out.index] = now


# ---- the answer ---------------------------------------------------------------------------


class Answer(ABC):
    """One answer built from engine outputs, whole or streamed: the part every protocol shares.

    Whole: `add` takes each output, then `whole()` is the JSON body. Streamed: the events of
    `opening()`, of `events(out)` for each output, then of `closing()`, each framed for the
    wire (`sse.event`); an error after the headers went out becomes one last event, and `end`
    (when set) closes the stream even then.
    """

    id_prefix: ClassVar[str]  # of the answer's id: "chatcmpl-" for OpenAI chat
    end: ClassVar[str] = ""  # the stream's last event
    media_type: ClassVar[str] = "text/event-stream"  # of a streamed answer

    def __init__(self, state: ModelState, common: Common, num_choices: int) -> None:
        self.state = state
        self.common = common
        self.num_choices = num_choices
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = Usage()  # filled in by `outputs` as they pass

    @abstractmethod
    def add(self, out: RequestOutput) -> None:
        """Adds one output to the whole answer."""

    @abstractmethod
    def whole(self) -> dict[str, Any]:
        """The whole answer's JSON body, once every output is in."""

    def opening(self) -> list[str]:
        return []

    @abstractmethod
    def events(self, out: RequestOutput) -> list[str]:
        """The events one output streams."""

    def closing(self) -> list[str]:
        return []

    def error_events(self, exc: Exception) -> list[str]:
        """The events that tell a streaming client of an error after the headers went out."""
        return [sse.error_event(exc)]

    async def collect(self, merged: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        async for out in merged:
            self.add(out)
        return self.whole()

    async def stream(self, merged: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        try:
            for event in self.opening():
                yield event
            async for out in merged:
                for event in self.events(out):
                    yield event
            for event in self.closing():
                yield event
        except Exception as exc:
            for event in self.error_events(exc):
                yield event
        finally:
            await merged.aclose()
        if self.end:
            yield self.end


class ChoicesAnswer(Answer):
    """The envelope OpenAI's chat and completions share: n choices, finish reasons, usage; streams
    of chunks (with usage when asked), then `data: [DONE]`. A protocol fills in `choice(i)`, the
    whole answer's choice i, and the choices its chunks carry."""

    object: ClassVar[str]  # the whole answer's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's "object"
    end = sse.DONE

    def __init__(self, state: ModelState, common: Common, num_choices: int) -> None:
        super().__init__(state, common, num_choices)
        self.finish_reasons = ["stop"] * num_choices  # of the whole answer, set by `add`

    def finish_reason(self, out: RequestOutput) -> str:
        """OpenAI's reason for an engine's: "stop" or "length" (an abort only happens on shutdown)."""
        if out.finish_reason == "abort":
            raise APIError(503, "the server is shutting down; the request was stopped")
        return out.finish_reason or "stop"

    @abstractmethod
    def choice(self, index: int) -> dict[str, Any]: ...

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": [self.choice(i) for i in range(self.num_choices)],
            "usage": self.usage.as_dict(),
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.common.include_usage:
            payload["usage"] = usage
        return sse.event(payload)

    def closing(self) -> list[str]:
        return [self.chunk([], self.usage.as_dict())] if self.common.include_usage else []


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text, as logprobs show it."""
    return tokenizer.decode([token_id])
