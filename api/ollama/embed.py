"""Ollama's embeddings: POST /api/embed (normalized vectors, one or more inputs) and the older
POST /api/embeddings (one prompt, one vector, not normalized), on the engine's embedding path."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api.embeddings import EmbeddingJob, check_count, read_pooling, run_embeddings
from baselm.api.errors import bad_request
from baselm.api.ollama.request import read_body, sampling_from_options
from baselm.api.state import ModelState


def _embed_inputs(state: ModelState, value: Any, truncate: bool, name: str) -> list[list[int]]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise bad_request(f"{name} must be a string or a non-empty array of strings", name)
    check_count(len(items), name)
    ids = [state.tokenizer.encode(s) or [state.tokenizer.bos_token_id or 0] for s in items]
    limit = state.max_model_len
    if any(len(i) > limit for i in ids):
        if not truncate:
            raise bad_request(f"an input is longer than the model's {limit} tokens and truncate is false", name)
        ids = [i[:limit] for i in ids]
    return ids


async def ollama_embed(request: Request) -> Response:
    """POST /api/embed: normalized vectors for one or more inputs."""
    state, body = await read_body(request)
    started = time.perf_counter_ns()
    raw_input, truncate = body.raw("input"), body.boolean("truncate", default=True)
    pooling = read_pooling(body, state)
    if body.raw("dimensions") is not None:
        raise bad_request("dimensions is not supported: a decoder model's hidden size is fixed", "dimensions")
    sampling_from_options(body)
    body.raw("keep_alive")
    body.finish()
    inputs = await asyncio.to_thread(_embed_inputs, state, raw_input, truncate, "input")
    vectors = await run_embeddings(request, state, EmbeddingJob(inputs, pooling, True), "input")
    tokens = sum(map(len, inputs))
    state.metrics.count_tokens(tokens, 0)
    return JSONResponse(
        {
            "model": body.data["model"],
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }
    )


async def ollama_embeddings(request: Request) -> Response:
    """POST /api/embeddings, the older form: one prompt, one vector, not normalized."""
    state, body = await read_body(request)
    prompt = body.string("prompt", required=True)
    pooling = read_pooling(body, state)
    sampling_from_options(body)
    body.raw("keep_alive")
    body.finish()
    inputs = await asyncio.to_thread(_embed_inputs, state, prompt, True, "prompt")
    vectors = await run_embeddings(request, state, EmbeddingJob(inputs, pooling, False), "prompt")
    return JSONResponse({"embedding": vectors[0].tolist()})
