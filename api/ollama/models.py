"""Ollama's model routes that read: /api/tags, /api/show, /api/ps, /api/version, and `GET /`.

/api/tags lists the served models, then the rest of the local store (`base list`); /api/ps the
loaded ones with when they unload; in both, a model's LoRA adapters follow it, each an entry whose
`details.parent_model` names it. /api/show reads a stored model's header without loading it.
The routes that change the store (/api/pull, /api/copy, /api/delete) are store_routes.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from baselm import version
from baselm.api import serving
from baselm.api.errors import bad_request
from baselm.api.ollama.lines import now_rfc3339
from baselm.api.pool import PoolEntry, pool_of
from baselm.api.schemas import Body
from baselm.api.state import ModelState, ServerState
from baselm.store.model_card import architecture, capabilities, parameter_label


def digest(*parts: Any) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()


def _stored_entry(model: Any) -> dict[str, Any]:
    """One store model as Ollama lists it."""
    details = {
        "parent_model": "",
        "format": "base",
        "family": model.arch,
        "families": [model.arch],
        "parameter_size": parameter_label(model.params),
        "quantization_level": model.quant.upper(),
    }
    return {
        "name": model.ref,
        "model": model.ref,
        "modified_at": model.pulled or now_rfc3339(),
        "size": model.size,
        "digest": digest(model.ref, model.size, model.pulled),
        "details": details,
    }


def served_entry(state: ModelState) -> dict[str, Any]:
    """The served model as Ollama lists it."""
    loaded = state.client.engine.loaded
    config = loaded.config
    arch = str(config.get("model_type", "unknown"))
    size = loaded.path.stat().st_size if loaded.path.is_file() else _folder_size(loaded.path)
    params = num_params(loaded.model)
    details = {
        "parent_model": "",
        "format": loaded.path.suffix.lstrip(".") or "folder",
        "family": arch,
        "families": [arch],
        "parameter_size": parameter_label(params),
        "quantization_level": _quantization(loaded.model),
    }
    return {
        "name": state.model_name,
        "model": state.model_name,
        "modified_at": datetime.fromtimestamp(loaded.path.stat().st_mtime, timezone.utc).isoformat(),
        "size": size,
        "digest": digest(loaded.path.resolve(), size),
        "details": details,
    }


def adapter_entries(state: ModelState, entry: dict[str, Any], on_disk: bool) -> list[dict[str, Any]]:
    """The LoRA adapters `state`'s model serves, as Ollama lists models: its `entry` under each
    adapter's name and digest, with the model as `details.parent_model`; the size is the adapter's
    files' when `on_disk` (/api/tags), else what its factors hold in memory beside the model (/api/ps)."""
    served = state.served_adapters
    listed = []
    for adapter in served.adapters if served is not None else []:
        path = adapter.path
        size = (path.stat().st_size if path.is_file() else _folder_size(path)) if on_disk else adapter.nbytes
        named = {"name": adapter.name, "model": adapter.name, "digest": digest(adapter.fingerprint, adapter.scale)}
        details = {**entry["details"], "parent_model": state.model_name}
        listed.append({**entry, **named, "size": size, "details": details})
    return listed


def num_params(model: Any) -> int:
    """The model's weights, counted as values: a quantized weight's packed codes count as the values they
    hold, its scales and biases not at all."""
    from mlx.utils import tree_flatten

    bits = {path: m.bits for path, m in model.named_modules() if hasattr(m, "bits")}
    total = 0
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        if module not in bits or leaf not in ("weight", "scales", "biases"):
            total += value.size
        elif leaf == "weight":
            total += value.size * 32 // bits[module]
    return total


def _quantization(model: Any) -> str:
    bits = {getattr(m, "bits", None) for _, m in model.named_modules()} - {None}
    return "/".join(f"Q{b}" for b in sorted(bits)) if bits else str(model.dtype).split(".")[-1].upper()


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def ollama_root(request: Request) -> Response:
    """GET / and HEAD /: clients probe it to see that the server runs."""
    return PlainTextResponse("base is running (Ollama API under /api)")


async def ollama_version(request: Request) -> Response:
    return JSONResponse({"version": version()})


async def ollama_tags(request: Request) -> Response:
    """GET /api/tags: the served models (a loaded one as it runs), then the rest of the local store."""
    from baselm.store.registry import Store

    await pool_of(request).refresh()
    stored = {m.ref: m for m in await asyncio.to_thread(lambda: Store().list())}
    listed = []
    for entry in pool_of(request):
        model = stored.pop(entry.servable.ref, None)
        if entry.state is not None:
            listed.append(served_entry(entry.state))
            listed += adapter_entries(entry.state, listed[-1], on_disk=True)
        elif model is not None:
            listed.append({**_stored_entry(model), "name": entry.name, "model": entry.name})
        else:
            listed.append(_path_entry(entry))
    served_paths = {e.state.client.engine.loaded.path.resolve() for e in pool_of(request).loaded()}  # type: ignore[union-attr]
    others = [_stored_entry(m) for m in stored.values() if m.path.resolve() not in served_paths]
    return JSONResponse({"models": listed + others})


def _path_entry(entry: PoolEntry) -> dict[str, Any]:
    """A model named by its path and not loaded: what is known without reading it."""
    details = {"parent_model": "", "format": Path(entry.servable.ref).suffix.lstrip(".") or "folder", "family": ""}
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": now_rfc3339(),
        "size": entry.size,
        "digest": digest(entry.servable.ref, entry.size),
        "details": {**details, "families": [], "parameter_size": "", "quantization_level": ""},
    }


def _expires_at(entry: PoolEntry) -> str:
    """When a loaded model unloads: its keep-alive's end, or (in use, or kept for ever) far ahead."""
    if entry.expires_at is not None:
        return datetime.fromtimestamp(entry.expires_at, timezone.utc).isoformat()
    ahead = timedelta(days=365 * 100) if entry.keep_alive is None or entry.pinned else timedelta(0)
    return (datetime.now(timezone.utc) + ahead).isoformat() if ahead else now_rfc3339()


async def ollama_ps(request: Request) -> Response:
    """GET /api/ps: the models this server holds in memory, with their size and when they unload."""
    models = []
    for entry in pool_of(request).loaded():
        state = entry.state
        assert state is not None
        listed = served_entry(state)
        on_gpu = state.client.engine.loaded.backend.is_gpu
        listed.update(
            size=entry.size,
            expires_at=_expires_at(entry),
            size_vram=entry.size if on_gpu else 0,
            context_length=state.max_model_len,
        )
        adapters = adapter_entries(state, listed, on_disk=False)
        models += [listed, *({**a, "size_vram": a["size"] if on_gpu else 0} for a in adapters)]
    return JSONResponse({"models": models})


async def ollama_show(request: Request) -> Response:
    """POST /api/show: a model's details, template and hyperparameters; a stored model is read from
    its file without loading it, any other is loaded to be shown."""
    server: ServerState = request.app.state.base
    body = Body(await serving.read_json(request, server))
    name = body.string("model") or body.string("name")
    body.boolean("verbose")
    body.finish()
    if not name:
        raise bad_request("model is required", "model")
    entry = await pool_of(request).lookup(name)
    if entry.state is None and _has_header(entry):
        return JSONResponse(await asyncio.to_thread(stored_show, entry))
    state = entry.state or await pool_of(request).load(entry)
    return JSONResponse(_loaded_show(state))


def _has_header(entry: PoolEntry) -> bool:
    """A store model or a `.base` file: its header says what /api/show tells."""
    path = Path(entry.servable.ref).expanduser()
    return not path.exists() or (path.is_file() and path.suffix == ".base")


def _loaded_show(state: ModelState) -> dict[str, Any]:
    entry = served_entry(state)
    config = state.client.engine.loaded.config
    arch = entry["details"]["family"]
    info = {"general.architecture": arch, "general.parameter_count": num_params(state.client.engine.loaded.model)}
    # the stored model's shape, with the context and the vocabulary as this server runs them
    shape = {**architecture(config), "context_length": state.max_model_len, "vocab_size": state.vocab_size}
    info.update({f"{arch}.{key}": value for key, value in shape.items() if value is not None})
    template = state.tokenizer.to_hf_files()[1].get("chat_template") or ""
    abilities = capabilities(config, template if isinstance(template, str) else str(template))
    return _show_body(state.model_name, template, entry["details"], info, entry["modified_at"], abilities)


def _show_body(
    name: str, template: Any, details: dict, info: dict, modified_at: str, abilities: list[str]
) -> dict[str, Any]:
    return {
        "license": "",
        "modelfile": f"# served by base\nFROM {name}\n",  # never a path on this machine
        "parameters": "",
        "template": template if isinstance(template, str) else "",
        "details": details,
        "model_info": info,
        "capabilities": abilities,
        "modified_at": modified_at,
    }


def stored_show(entry: PoolEntry) -> dict[str, Any]:
    """/api/show of a model not loaded, from its `.base` file's header (store/model_card.py)."""
    from baselm.loader import resolve
    from baselm.store.base_reader import BaseFile
    from baselm.store.model_card import model_card

    path = resolve(entry.servable.ref)[1]
    card = model_card(BaseFile.open(path))
    arch = card["arch"]
    details = {
        "parent_model": "",
        "format": "base",
        "family": arch,
        "families": [arch],
        "parameter_size": parameter_label(card["params"]),
        "quantization_level": str(card["quantization"]["scheme"]).upper(),
    }
    info = {"general.architecture": arch, "general.parameter_count": card["params"]}
    shape = {**card["architecture"], "context_length": card["context_length"]}
    info.update({f"{arch}.{key}": value for key, value in shape.items() if value is not None})
    modified_at = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()
    return _show_body(entry.name, card["chat_template"] or "", details, info, modified_at, card["capabilities"])
