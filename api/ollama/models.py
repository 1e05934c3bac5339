"""Ollama's model routes: /api/tags, /api/show, /api/ps, /api/version, /api/pull, and `GET /`.

/api/tags lists the local store (`base list`) with the served model first; only the served
model answers /api/chat and the others (start `base serve NAME` for them). /api/pull brings a
hub model into the store through the same code as `base pull`, streaming its progress.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from baselm import version
from baselm.api import serving, sse
from baselm.api.errors import APIError, bad_request, logger
from baselm.api.ollama.lines import line, now_rfc3339
from baselm.api.ollama.request import check_model_name
from baselm.api.schemas import Body
from baselm.store.model_card import architecture, parameter_label


def _digest(*parts: Any) -> str:
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
        "digest": _digest(model.ref, model.size, model.pulled),
        "details": details,
    }


def served_entry(state: serving.ServerState) -> dict[str, Any]:
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
        "digest": _digest(loaded.path.resolve(), size),
        "details": details,
    }


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
    """GET /api/tags: the served model, then the rest of the local store."""
    from baselm.store.registry import Store

    state: serving.ServerState = request.app.state.base
    served = served_entry(state)
    stored = await asyncio.to_thread(lambda: Store().list())
    loaded_path = state.client.engine.loaded.path.resolve()
    others = [_stored_entry(m) for m in stored if m.path.resolve() != loaded_path]
    return JSONResponse({"models": [served, *others]})


async def ollama_ps(request: Request) -> Response:
    """GET /api/ps: the model this server holds in memory."""
    state: serving.ServerState = request.app.state.base
    entry = served_entry(state)
    on_gpu = state.client.engine.loaded.backend.is_gpu
    entry.update(
        expires_at=(datetime.now(timezone.utc) + timedelta(days=365)).isoformat(),
        size_vram=entry["size"] if on_gpu else 0,
        context_length=state.max_model_len,
    )
    return JSONResponse({"models": [entry]})


async def ollama_show(request: Request) -> Response:
    """POST /api/show: the served model's details, template and hyperparameters."""
    state: serving.ServerState = request.app.state.base
    body = Body(await serving.read_json(request, state))
    name = body.string("model") or body.string("name")
    body.boolean("verbose")
    body.finish()
    check_model_name(state, name)
    entry = served_entry(state)
    config = state.client.engine.loaded.config
    arch = entry["details"]["family"]
    info = {"general.architecture": arch, "general.parameter_count": num_params(state.client.engine.loaded.model)}
    # the stored model's shape, with the context and the vocabulary as this server runs them
    shape = {**architecture(config), "context_length": state.max_model_len, "vocab_size": state.vocab_size}
    info.update({f"{arch}.{key}": value for key, value in shape.items() if value is not None})
    template = state.tokenizer.to_hf_files()[1].get("chat_template") or ""
    capabilities = ["completion", "embedding"] + (["tools"] if "tools" in str(template) else [])
    return JSONResponse(
        {
            "license": "",
            "modelfile": f"# served by base\nFROM {state.model_name}\n",  # never a path on this machine
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": entry["details"],
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


_STATUS = "_status"  # the HTTP status of a pull's error, for a whole (unstreamed) answer; never sent


class _QueueProgress:
    """A pull's download progress as Ollama's status objects, handed to the event loop through a queue."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        self.out = out
        self.label, self.total, self.done = "", 0, 0

    def start(self, label: str, total: int, done: int) -> None:
        self.label, self.total, self.done = label, total, done
        self._send()

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        self._send()

    def finish(self) -> None:
        self.done = self.total
        self._send()

    def _send(self) -> None:
        digest = _digest(self.label)
        self.out.put(
            {
                "status": f"pulling {self.label}",
                "digest": f"sha256:{digest}",
                "total": self.total,
                "completed": self.done,
            }
        )


def _without_store_path(message: str) -> str:
    """A store error as the API says it: the store's folder named `$BASE_HOME`, never its place on this machine."""
    from baselm.store.default_model import base_home

    home = base_home()
    for place in sorted({str(home.resolve()), str(home)}, key=len, reverse=True):
        message = message.replace(place, "$BASE_HOME")
    return message


def _pull_worker(ref: str, out: queue.SimpleQueue) -> None:
    from baselm.models import supported_model_types
    from baselm.store import pull as pulling
    from baselm.store.errors import StoreError

    try:
        out.put({"status": "pulling manifest"})
        stored = pulling.pull(ref, supported=set(supported_model_types()), progress=_QueueProgress(out))
        out.put({"status": "writing manifest"})
        out.put({"status": "success", "model": stored.ref})
    except (StoreError, OSError, ValueError) as exc:
        out.put({"error": _without_store_path(str(exc)), _STATUS: 400})
    except Exception as exc:  # a bug: say so without a traceback on the wire
        logger.exception("pull of %s failed", ref, exc_info=exc)
        out.put({"error": "the pull failed with an internal error; see the server log", _STATUS: 500})
    finally:
        out.put(None)


async def _pull_events(ref: str) -> AsyncIterator[dict[str, Any]]:
    out: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_pull_worker, args=(ref, out), name="base-pull", daemon=True).start()
    while True:
        try:
            item = out.get_nowait()
        except queue.Empty:
            await asyncio.sleep(0.05)
            continue
        if item is None:
            return
        yield item


async def ollama_pull(request: Request) -> Response:
    """POST /api/pull: a hub model (org/name[:tag]) into the store, with progress lines when streamed."""
    state: serving.ServerState = request.app.state.base
    body = Body(await serving.read_json(request, state))
    ref = body.string("model") or body.string("name")
    body.boolean("insecure")
    stream = body.boolean("stream", default=True)
    body.finish()
    if not ref or "/" not in ref.split(":", 1)[0] or ref.startswith(("/", ".", "~")):
        raise bad_request("model must be a hub repository, org/name[:tag]", "model")
    events = _pull_events(ref)
    if stream:
        return sse.EventStream(_as_lines(events), "application/x-ndjson")
    last: dict[str, Any] = {}
    async for item in events:
        last = item
    if "error" in last:
        raise APIError(last[_STATUS], last["error"], "model")
    return JSONResponse({"status": last.get("status", "success")})


async def _as_lines(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for item in events:
        item.pop(_STATUS, None)
        yield line(item)
