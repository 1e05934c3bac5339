"""POST /v1/embeddings (OpenAI): pooled hidden states of the served model (see baselm/embedding.py)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api.errors import bad_request
from baselm.api.pool import pool_of
from baselm.api.schemas import Body, check_choice
from baselm.api.serving import read_json, unless_disconnected
from baselm.api.state import ModelState, ServerState
from baselm.embedding import POOLINGS, EmbeddingError, check_num_inputs, default_pooling


@dataclass(slots=True)
class EmbeddingJob:
    """Token ids of each input, how to pool them, and whether to scale each vector to length 1."""

    inputs: list[list[int]]
    pooling: str
    normalize: bool


async def run_embeddings(request: Request, state: ModelState, job: EmbeddingJob, param: str) -> list[np.ndarray]:
    """The vectors, computed on the engine thread a slice at a time between steps; refusals become
    400s naming `param`, and a client that disconnects drops the work not done yet. Embeddings are the
    model's own: a LoRA adapter's name is refused (adapters serve generation)."""
    if state.adapter is not None:
        raise bad_request(
            f"{state.model_name!r} is a LoRA adapter, which serves generation; embeddings come from the model it "
            "adapts: name that model",
            "model",
        )
    for ids in job.inputs:
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"token {bad[0]} is outside the vocabulary of {state.vocab_size}", param)
    try:
        return await unless_disconnected(request, state.client.embed(job.inputs, job.pooling, job.normalize))
    except EmbeddingError as exc:
        raise bad_request(str(exc), param) from None


def check_count(num_inputs: int, param: str) -> None:
    """A 400 naming `param` when a request holds more inputs than the engine takes (before any is tokenized)."""
    try:
        check_num_inputs(num_inputs)
    except EmbeddingError as exc:
        raise bad_request(str(exc), param) from None


def read_pooling(body: Body, state: ModelState) -> str:
    """The `pooling` extension field, else the model family's default (see baselm/embedding.py)."""
    pooling = body.string("pooling")
    if pooling is None:
        return default_pooling(state.client.engine.loaded.config)
    return check_choice(pooling, POOLINGS, "pooling")


def _inputs(value: Any, state: ModelState) -> list[list[int]]:
    """`input` as token ids: a string, an array of strings, an array of ids, or an array of arrays of ids."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty array of strings or token arrays", "input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    check_count(len(value), "input")
    ids = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            ids.append(state.tokenizer.encode(item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids.append(list(item))
        else:
            raise bad_request(f"input[{i}] must be a string or an array of token ids", "input")
        if not ids[-1]:
            raise bad_request(f"input[{i}] is empty", "input")
    return ids


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    server: ServerState = request.app.state.base
    body = Body(await read_json(request, server))
    state = await pool_of(request).acquire(request.scope, body.string("model", required=True))
    raw_input = body.raw("input")
    encoding = body.string("encoding_format", default="float")
    if encoding not in ("float", "base64"):
        raise bad_request(f"encoding_format {encoding!r} is not float or base64", "encoding_format")
    if body.raw("dimensions") is not None:
        raise bad_request("dimensions is not supported: a decoder model's hidden size is fixed", "dimensions")
    body.string("user")
    pooling = read_pooling(body, state)
    normalize = body.boolean("normalize", default=True)
    body.finish()
    inputs = await asyncio.to_thread(_inputs, raw_input, state)
    vectors = await run_embeddings(request, state, EmbeddingJob(inputs, pooling, normalize), "input")
    tokens = sum(map(len, inputs))
    state.metrics.count_tokens(tokens, 0)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
