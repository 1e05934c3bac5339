"""The starlette application: routes, error handlers, auth, and the engine's lifetime.

`create_app(client, model_name)` serves an already started AsyncEngine; server.py builds
one from a model path and runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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
from baselm.api.ollama.chat import ollama_chat, ollama_generate
from baselm.api.ollama.embed import ollama_embed, ollama_embeddings
from baselm.api.ollama.models import (
    ollama_ps,
    ollama_pull,
    ollama_root,
    ollama_show,
    ollama_tags,
    ollama_version,
)
from baselm.api.openai.chat import chat_completions, read_message
from baselm.api.openai.completions import completions
from baselm.api.openai.responses import create_response, delete_response, get_response
from baselm.api.openai.responses_store import ResponseStore
from baselm.api.rerank import rerank
from baselm.api.schemas import Body, array_field
from baselm.api.serving import DEFAULT_MAX_BODY_BYTES, ServerState, check_model, read_json
from baselm.api.webui import is_public, with_page
from baselm.async_engine import AsyncEngine
from baselm.reasoning import template_thinks
from baselm.sampling.defaults import NO_DEFAULTS, SamplingDefaults
from baselm.tokenizer.errors import ChatTemplateError
from baselm.toolcalls.markers import detect_format


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "base",
        "root": state.model_name,  # vLLM's and SGLang's cards name the base model here
        "max_model_len": state.max_model_len,
        # What a request gets for what it leaves out: the token cap (None: the context's room) and sampling.
        "max_tokens": state.generation.max_tokens,
        "sampling_defaults": {k: v for k, v in state.generation.resolved().as_dict().items() if k != "max_tokens"},
    }


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.base
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.base
    check_model(state, request.path_params["model"])
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.base
    stats = await state.client.run_on_engine(lambda engine: engine.stats())
    return PlainTextResponse(state.metrics.render(stats, state.model_name), media_type="text/plain; version=0.0.4")


async def _read_body(request: Request) -> tuple[ServerState, Body]:
    """The body of a tokenizer route, whose `model` field is optional."""
    state: ServerState = request.app.state.base
    body = Body(await read_json(request, state))
    model = body.string("model")
    if model is not None:
        check_model(state, model)
    return state, body


def _tokens(state: ServerState, body: Body) -> list[int]:
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


def _text(state: ServerState, tokens: Any) -> str:
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
]


def create_app(
    client: AsyncEngine,
    model_name: str,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    cors_origins: Sequence[str] = (),
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
    sampling_defaults: SamplingDefaults = NO_DEFAULTS,
    webui: bool = True,
) -> Starlette:
    """The OpenAI-compatible app over a started AsyncEngine; `api_key` None serves without auth.

    `cors_origins`: the web origins whose pages may call the API from a browser ("*": any;
    "localhost": any page served from this machine, on any port); none by default. CORS sits
    outside auth: a browser's preflight carries no API key, and an error answer must carry the
    CORS headers for the page to read it. `host` (the bound address) and `allowed_hosts` say
    which Host names are answered; guard.py refuses the rest, foreign origins and non-JSON bodies.
    `sampling_defaults`: the command line's, for what requests leave out (baselm/sampling/defaults.py).
    `webui`: the chat page at `/` for browsers (webui/); off, `/` is Ollama's probe alone.
    """
    key = api_key or None
    state = ServerState(client, model_name, key, max_body_bytes, read_timeout, sampling_defaults=sampling_defaults)
    chat_template = state.tokenizer.to_hf_files()[1].get("chat_template")
    state.tool_format = detect_format(chat_template)
    state.thinks = template_thinks(chat_template)
    middleware = [
        Middleware(Gate, api_key=state.api_key, metrics=state.metrics, is_public=is_public if webui else None),
        Middleware(BrowserGuard, host_names=allowed_host_names(host, allowed_hosts), cors_origins=cors_origins),
    ]
    if cors_origins:
        middleware.insert(0, cors_middleware(cors_origins))
    app = Starlette(
        routes=with_page(ROUTES) if webui else ROUTES, exception_handlers=EXCEPTION_HANDLERS, middleware=middleware
    )
    app.state.base = state
    app.state.responses = ResponseStore()
    return app


__all__ = ["create_app"]
