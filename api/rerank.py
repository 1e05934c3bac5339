"""POST /v1/rerank (also /rerank and /v2/rerank): documents ordered by relevance to a query.

Request and response follow llama-server's, Jina's and Cohere's rerank APIs, which agree on
`query`, `documents` (strings, or objects with `text`), `top_n` and `return_documents`, and on
`results[]` of `{index, relevance_score}` ordered best first; `document: {text}` is added when
`return_documents` is true. `instruction` (an extension) replaces the reranker's default task.
The model must be a reranker, by what it is (a classification head) or, for a causal-LM reranker
without one, by its name (see baselm/rerank.py); another answers a 400 naming it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api.errors import bad_request
from baselm.api.pool import pool_of
from baselm.api.schemas import Body
from baselm.api.serving import Job, Usage, outputs, read_json, submit, unless_disconnected
from baselm.api.state import ModelState, ServerState
from baselm.rerank import LabelLogits, Ranker, RerankError, ranker_for
from baselm.sampling.params import SamplingParams

MAX_DOCUMENTS = 1024


async def rerank(request: Request) -> Response:
    """POST /v1/rerank."""
    server: ServerState = request.app.state.base
    body = Body(await read_json(request, server))
    state = await pool_of(request).acquire(request.scope, body.string("model", required=True))
    query = body.string("query", required=True)
    documents = _documents(body.raw("documents"))
    top_n = body.integer("top_n", low=1, default=len(documents))
    return_documents = body.boolean("return_documents", default=False)
    instruction = body.string("instruction")
    body.finish()
    ranker = _ranker(state)
    ids = await asyncio.to_thread(_prompts, ranker, query, documents, instruction)
    scorers = [LabelLogits(ranker.label_ids) for _ in documents]
    jobs = [Job(p, _params(scorer), i, i) for i, (p, scorer) in enumerate(zip(ids, scorers, strict=True))]
    usage = Usage()
    await unless_disconnected(request, _run(state, jobs, usage))
    scores = [ranker.relevance(scorer.values) for scorer in scorers]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    tokens = usage.as_dict()["prompt_tokens"]
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": state.model_name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def _params(scorer: LabelLogits) -> SamplingParams:
    """One answer token, greedy: the scorer reads the logits it is chosen from."""
    return SamplingParams(max_tokens=1, temperature=0.0, logits_processors=[scorer])


async def _run(state: ModelState, jobs: list[Job], usage: Usage) -> None:
    async for _ in outputs(state, await submit(state, jobs, "documents"), usage):
        pass


def _ranker(state: ModelState) -> Ranker:
    loaded = state.client.engine.loaded
    try:
        return ranker_for(state.model_name, loaded.config, state.tokenizer, loaded.name)
    except RerankError as exc:
        raise bad_request(str(exc), "model") from None


def _prompts(ranker: Ranker, query: str, documents: list[str], instruction: str | None) -> list[list[int]]:
    try:
        return [ranker.prompt_ids(query, document, instruction) for document in documents]
    except RerankError as exc:
        raise bad_request(str(exc), "instruction") from None


def _documents(value: Any) -> list[str]:
    """`documents`: strings, or objects with a string `text` (Jina, Cohere v2)."""
    if not isinstance(value, list) or not value:
        raise bad_request("documents must be a non-empty array of strings (or of objects with 'text')", "documents")
    if len(value) > MAX_DOCUMENTS:
        raise bad_request(f"documents holds {len(value)} documents; at most {MAX_DOCUMENTS} a request", "documents")
    texts = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise bad_request(f"documents[{i}] is not a string (or an object with a string 'text')", "documents")
        texts.append(text)
    return texts
