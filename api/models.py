"""The model listings and controls outside Ollama's API: OpenAI's `/v1/models` and llama-server's
router endpoints (`GET /models`, `POST /models/load`, `POST /models/unload`).

Both listings name every servable model with its state as llama-server's router writes it,
`"status": {"value": "loaded" | "loading" | "unloaded"}`; a loaded model's card adds what a
request gets for what it leaves out (its context, token cap and sampling defaults). The LoRA
adapters a model serves follow it, each a card of its own as vLLM lists them: `root` its path,
`parent` the model it adapts.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api.errors import APIError
from baselm.api.pool import PoolEntry, adapter_names, pool_of
from baselm.api.schemas import Body
from baselm.api.serving import read_json
from baselm.api.state import ServerState


def model_card(server: ServerState, entry: PoolEntry) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": entry.name,
        "object": "model",
        "created": server.created,
        "owned_by": "base",
        "root": entry.name,  # vLLM's and SGLang's cards name the base model here
        "parent": None,  # an adapter's card names the model it adapts here
        "status": {"value": entry.status},
    }
    state = entry.state
    if state is not None:
        generation = state.generation
        card["max_model_len"] = state.max_model_len
        # What a request gets for what it leaves out: the token cap (None: the context's room) and sampling.
        card["max_tokens"] = generation.max_tokens
        card["sampling_defaults"] = {k: v for k, v in generation.resolved().as_dict().items() if k != "max_tokens"}
    return card


def adapter_card(server: ServerState, entry: PoolEntry, name: str) -> dict[str, Any]:
    """The card of the LoRA adapter `name` of `entry`'s model (loaded: adapters are served by loaded models)."""
    adapter = entry.state.served_adapters.find(name)  # type: ignore[union-attr]
    card = model_card(server, entry)
    return {**card, "id": name, "root": str(adapter.path), "parent": entry.name}


async def list_models(request: Request) -> Response:
    """GET /v1/models and GET /models: every servable model, loaded or not, each followed by its adapters."""
    server: ServerState = request.app.state.base
    await pool_of(request).refresh()
    cards = []
    for entry in pool_of(request):
        cards.append(model_card(server, entry))
        cards += [adapter_card(server, entry, name) for name in adapter_names(entry)]
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}."""
    server: ServerState = request.app.state.base
    name = request.path_params["model"]
    entry = await pool_of(request).lookup(name)
    if name in adapter_names(entry):
        return JSONResponse(adapter_card(server, entry, name))
    return JSONResponse(model_card(server, entry))


async def _named(request: Request) -> PoolEntry:
    """The model a router request's body names."""
    body = Body(await read_json(request, request.app.state.base))
    name = body.string("model", required=True)
    body.finish()
    return await pool_of(request).lookup(name)


async def load_model(request: Request) -> Response:
    """POST /models/load {"model"}: loads it now (its keep-alive starts once it is loaded)."""
    entry = await _named(request)
    await pool_of(request).load(entry)
    return JSONResponse({"success": True})


async def unload_model(request: Request) -> Response:
    """POST /models/unload {"model"}: unloads it now, or once the requests it answers end."""
    entry = await _named(request)
    if entry.pinned:
        raise APIError(400, f"model {entry.name!r} was started with the server and stays loaded", "model")
    entry.keep_alive = 0
    await pool_of(request).unload(entry)
    return JSONResponse({"success": True})
