"""POST /v1/embeddings (OpenAI): pooled hidden states of the served model (see baselm/embedding.py)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api.errors import APIError, bad_request
from baselm.api.schemas import Body, check_choice
from baselm.api.serving import ServerState, check_model, read_json
from baselm.embedding import POOLINGS, EmbeddingError, default_pooling, embed

MAX_INPUTS = 2048  # as OpenAI's limit on inputs per request


@dataclass(slots=True)
class EmbeddingJob:
    """Token ids of each input, how to pool them, and whether to scale each vector to length 1."""

    inputs: list[list[int]]
    pooling: str
    normalize: bool


async def run_embeddings(state: ServerState, job: EmbeddingJob, param: str) -> list[np.ndarray]:
    """The vectors, computed on the engine thread between steps; refusals become 4xx naming `param`."""
    for ids in job.inputs:
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"token {bad[0]} is outside the vocabulary of {state.vocab_size}", param)
    try:
        return await state.client.run_on_engine(embed, job.inputs, job.pooling, job.normalize)
    except EmbeddingError as exc:
        status = 429 if "free blocks" in str(exc) else 400
        raise APIError(status, str(exc), param) from None


def read_pooling(body: Body, state: ServerState) -> str:
    """The `pooling` extension field, else the model family's default (see baselm/embedding.py)."""
    pooling = body.string("pooling")
    if pooling is None:
        return default_pooling(state.client.engine.loaded.config)
    return check_choice(pooling, POOLINGS, "pooling")


def _inputs(value: Any, state: ServerState) -> list[list[int]]:
    """`input` as token ids: a string, an array of strings, an array of ids, or an array of arrays of ids."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty array of strings or token arrays", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds {len(value)} items; the limit is {MAX_INPUTS}", "input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
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
    state: ServerState = request.app.state.base
    body = Body(await read_json(request, state))
    check_model(state, body.string("model", required=True))
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
    vectors = await run_embeddings(state, EmbeddingJob(inputs, pooling, normalize), "input")
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
