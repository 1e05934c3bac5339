"""The starlette application: routes, error handlers, auth, and the model pool.

`create_app(client, model_name)` serves an already started AsyncEngine; with a `PoolSetup` it
serves the models a loader starts on demand (pool.py). server.py runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from baselm.api.anthropic.messages import count_tokens, messages
from baselm.api.auth import Gate
from baselm.api.connections import DEFAULT_READ_TIMEOUT
from baselm.api.cors import cors_middleware
from baselm.api.embeddings import embeddings
from baselm.api.errors import EXCEPTION_HANDLERS, bad_request
from baselm.api.guard import BrowserGuard, allowed_host_names
from baselm.api.lora_adapters import list_adapters, set_adapters
from baselm.api.models import get_model, list_models, load_model, unload_model
from baselm.api.ollama.chat import ollama_chat, ollama_generate
from baselm.api.ollama.embed import ollama_embed, ollama_embeddings
from baselm.api.ollama.models import (
    ollama_ps,
    ollama_root,
    ollama_show,
    ollama_tags,
    ollama_version,
)
from baselm.api.ollama.store_routes import ollama_copy, ollama_delete, ollama_pull
from baselm.api.openai.chat import chat_completions, read_message
from baselm.api.openai.completions import completions
from baselm.api.openai.responses import create_response, delete_response, get_response
from baselm.api.openai.responses_store import ResponseStore
from baselm.api.pool import ModelLoader, ModelPool, PoolLimits, ReleaseLeases, Servable, pool_of
from baselm.api.rerank import rerank
from baselm.api.schemas import Body, array_field
from baselm.api.serving import read_json
from baselm.api.state import DEFAULT_MAX_BODY_BYTES, ModelState, ServerState
from baselm.api.webui import is_public, with_page
from baselm.async_engine import AsyncEngine
from baselm.sampling.defaults import NO_DEFAULTS, SamplingDefaults
from baselm.tokenizer.errors import ChatTemplateError


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    server: ServerState = request.app.state.base
    stats = {}
    for entry in pool_of(request).loaded():
        try:
            stats[entry.name] = await entry.state.client.run_on_engine(lambda engine: engine.stats())  # type: ignore[union-attr]
        except RuntimeError:  # it stopped meanwhile: unloaded
            continue
    return PlainTextResponse(server.metrics.render(stats), media_type="text/plain; version=0.0.4")


async def _read_body(request: Request) -> tuple[ModelState, Body]:
    """The body of a tokenizer route and the model it names; with one model served, `model` may be left out."""
    server: ServerState = request.app.state.base
    body = Body(await read_json(request, server))
    model = body.string("model")
    if model is None:
        names = pool_of(request).names()
        if len(names) != 1:
            raise bad_request(f"model is required: this server serves {len(names)} models", "model")
        model = names[0]
    return await pool_of(request).acquire(request.scope, model), body


def _tokens(state: ModelState, body: Body) -> list[int]:
    """The ids of a /tokenize body: its prompt (llama.cpp: content) or its messages through the chat template."""
    add_special = body.boolean("add_special_tokens", default=True)
    text_field = "content" if body.has("content") and not body.has("prompt") else "prompt"
    if body.has("messages") == body.has(text_field):
        raise bad_request("give either prompt or messages", "prompt")
    if body.has("messages"):
        messages = [read_message(m, i) for i, m in enumerate(array_field(body.raw("messages"), "messages"))]
        add_generation_prompt = body.boolean("add_generation_prompt", default=True)
        body.finish()
        try:
            return state.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    prompt = body.string(text_field, required=True)
    body.finish()
    return state.tokenizer.encode(prompt, add_special_tokens=add_special)


async def tokenize(request: Request) -> Response:
    """{"prompt": text} (llama.cpp: "content") or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
    state, body = await _read_body(request)
    tokens = await asyncio.to_thread(_tokens, state, body)  # NOTE: megabytes of text take seconds, off the loop
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})


def _text(state: ModelState, tokens: Any) -> str:
    """The text of a /detokenize body's `tokens`."""
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be an array of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < state.tokenizer.vocab_size]
    if bad:
        raise bad_request(f"token {bad[0]} is outside the vocabulary of {state.tokenizer.vocab_size}", "tokens")
    return state.tokenizer.decode(tokens)


async def detokenize(request: Request) -> Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    state, body = await _read_body(request)
    tokens = body.raw("tokens")
    body.finish()
    return JSONResponse({"prompt": await asyncio.to_thread(_text, state, tokens)})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    # llama-server's router (see models.py)
    Route("/models", list_models, methods=["GET"]),
    Route("/models/load", load_model, methods=["POST"]),
    Route("/models/unload", unload_model, methods=["POST"]),
    Route("/lora-adapters", list_adapters, methods=["GET"]),
    Route("/lora-adapters", set_adapters, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    *(Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
    # Ollama's API (see ollama/)
    Route("/", ollama_root, methods=["GET", "HEAD"]),
    Route("/api/chat", ollama_chat, methods=["POST"]),
    Route("/api/generate", ollama_generate, methods=["POST"]),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embeddings, methods=["POST"]),
    Route("/api/tags", ollama_tags, methods=["GET"]),
    Route("/api/show", ollama_show, methods=["POST"]),
    Route("/api/ps", ollama_ps, methods=["GET"]),
    Route("/api/version", ollama_version, methods=["GET"]),
    Route("/api/pull", ollama_pull, methods=["POST"]),
    Route("/api/copy", ollama_copy, methods=["POST"]),
    Route("/api/delete", ollama_delete, methods=["DELETE"]),
]


@dataclass(slots=True)
class PoolSetup:
    """The models a server loads itself: how (`loader`), which (`servables`), and when it unloads them."""

    loader: ModelLoader
    servables: list[Servable] = field(default_factory=list)
    limits: PoolLimits = field(default_factory=PoolLimits)


def create_app(
    client: AsyncEngine | None,
    model_name: str = "",
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    cors_origins: Sequence[str] = (),
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
    sampling_defaults: SamplingDefaults = NO_DEFAULTS,
    webui: bool = True,
    pool: PoolSetup | None = None,
    allow_image_urls: bool = False,
) -> Starlette:
    """The app over the models of `pool` and, when `client` is given, over that started AsyncEngine
    as `model_name` (pinned: never unloaded); `api_key` None serves without auth.

    `cors_origins`: the web origins whose pages may call the API from a browser ("*": any;
    "localhost": any page served from this machine, on any port); none by default. CORS sits
    outside auth: a browser's preflight carries no API key, and an error answer must carry the
    CORS headers for the page to read it. `host` (the bound address) and `allowed_hosts` say
    which Host names are answered; guard.py refuses the rest, foreign origins and non-JSON bodies.
    `sampling_defaults`: the command line's, for what requests leave out (baselm/sampling/defaults.py).
    `webui`: the chat page at `/` for browsers (webui/); off, `/` is Ollama's probe alone.
    `allow_image_urls`: fetch http(s) image URLs in messages (else only data URLs are taken).
    """
    state = ServerState(api_key or None, max_body_bytes, read_timeout, sampling_defaults=sampling_defaults)
    state.allow_image_urls = allow_image_urls
    models = ModelPool(state, pool.loader if pool else None, pool.limits if pool else None)
    for servable in pool.servables if pool else []:
        models.add(servable)
    if client is not None:
        path = str(client.engine.loaded.path)
        models.pin(ModelState.serving(client, model_name, state), Servable(model_name, path, 0))
    middleware = [
        Middleware(Gate, api_key=state.api_key, metrics=state.metrics, is_public=is_public if webui else None),
        Middleware(BrowserGuard, host_names=allowed_host_names(host, allowed_hosts), cors_origins=cors_origins),
        Middleware(ReleaseLeases, pool=models),
    ]
    if cors_origins:
        middleware.insert(0, cors_middleware(cors_origins))
    app = Starlette(
        routes=with_page(ROUTES) if webui else ROUTES, exception_handlers=EXCEPTION_HANDLERS, middleware=middleware
    )
    app.state.base = state
    app.state.pool = models
    app.state.responses = ResponseStore()
    return app


__all__ = ["create_app"]
