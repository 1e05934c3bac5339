"""Ollama's routes that change the store: /api/pull, /api/copy, /api/delete; the server's models follow.

/api/pull brings a hub model (org/name[:tag]) into the store through the same code as `base
pull`, or a local model file or folder (a `.gguf`, a `.base`, an HF or MLX folder) through `base
pull PATH`'s, streaming its progress; /api/copy gives a stored model a second name (`base cp`),
/api/delete removes one (`base rm`), unloading it first. Once the store has changed, the pool
reads it again, so a model pulled or copied is servable at once (`base serve` with no model).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.api import serving, sse
from baselm.api.errors import APIError, bad_request, logger
from baselm.api.ollama.lines import line
from baselm.api.ollama.models import digest
from baselm.api.pool import ModelPool, pool_of
from baselm.api.schemas import Body
from baselm.api.state import ServerState

_MODEL_SUFFIXES = (".gguf", ".base")


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
        self.out.put(
            {
                "status": f"pulling {self.label}",
                "digest": f"sha256:{digest(self.label)}",
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


def local_model(ref: str) -> Path | None:
    """The local model a pull names: an existing `.gguf` or `.base` file or a folder; None for a hub name."""
    if not ref.startswith(("/", ".", "~")):
        return None
    path = Path(ref).expanduser()
    return path if path.is_dir() or (path.is_file() and path.suffix in _MODEL_SUFFIXES) else None


def _store(ref: str, progress: _QueueProgress) -> Any:
    from baselm.models import supported_model_types
    from baselm.store import pull as pulling
    from baselm.store.import_local import import_local

    local = local_model(ref)
    if local is not None:
        return import_local(local, supported=set(supported_model_types()), progress=progress)
    return pulling.pull(ref, supported=set(supported_model_types()), progress=progress)


def _pull_worker(ref: str, out: queue.SimpleQueue) -> None:
    from baselm.store.errors import StoreError

    try:
        out.put({"status": "pulling manifest"})
        stored = _store(ref, _QueueProgress(out))
        out.put({"status": "writing manifest"})
        out.put({"status": "success", "model": stored.ref})
    except (StoreError, OSError, ValueError) as exc:
        out.put({"error": _without_store_path(str(exc)), _STATUS: 400})
    except Exception as exc:  # a bug: say so without a traceback on the wire
        logger.exception("pull of %s failed", ref, exc_info=exc)
        out.put({"error": "the pull failed with an internal error; see the server log", _STATUS: 500})
    finally:
        out.put(None)


async def _pull_events(ref: str, pool: ModelPool) -> AsyncIterator[dict[str, Any]]:
    """The pull's status objects as they come; once it succeeded, the pool serves the model."""
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
        if item.get("status") == "success":
            if pool.loader is not None:
                pool.loader.add(item["model"])
            await pool.refresh()
        yield item


async def ollama_pull(request: Request) -> Response:
    """POST /api/pull: a hub model (org/name[:tag]) or a local model's path into the store, with
    progress lines when streamed."""
    server: ServerState = request.app.state.base
    body = Body(await serving.read_json(request, server))
    ref = body.string("model") or body.string("name")
    body.boolean("insecure")
    stream = body.boolean("stream", default=True)
    body.finish()
    is_hub = ref and "/" in ref.split(":", 1)[0] and not ref.startswith(("/", ".", "~"))
    if not ref or not (is_hub or local_model(ref)):
        message = "model must be a hub repository, org/name[:tag], or the path of a local .gguf, .base or model folder"
        raise bad_request(message, "model")
    events = _pull_events(ref, pool_of(request))
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


async def ollama_copy(request: Request) -> Response:
    """POST /api/copy {"source", "destination"}: a second name for a stored model; 200 with no body."""
    from baselm.store.registry import Store

    server: ServerState = request.app.state.base
    body = Body(await serving.read_json(request, server))
    source = body.string("source", required=True)
    destination = body.string("destination", required=True)
    body.finish()
    entry = pool_of(request).find(source)
    copied = await _in_store(lambda: Store().copy(entry.servable.ref if entry else source, destination), "source")
    if pool_of(request).loader is not None:
        pool_of(request).loader.add(copied.ref)
    await pool_of(request).refresh()
    return Response(status_code=200)


async def ollama_delete(request: Request) -> Response:
    """DELETE /api/delete {"model"}: removes a stored model (unloaded first; a 409 while it answers)."""
    from baselm.store.registry import Store

    server: ServerState = request.app.state.base
    body = Body(await serving.read_json(request, server))
    name = body.string("model") or body.string("name")
    body.finish()
    if not name:
        raise bad_request("model is required", "model")
    entry = pool_of(request).find(name)
    if entry is not None and entry.state is not None and not await pool_of(request).unload(entry):
        raise APIError(409, f"model {entry.name!r} is answering requests; delete it once they end", "model")
    removed = await _in_store(lambda: Store().remove(entry.servable.ref if entry else name), "model")
    if pool_of(request).loader is not None:
        pool_of(request).loader.remove(entry.servable.ref if entry else removed.ref)
    await pool_of(request).refresh()
    return Response(status_code=200)


async def _in_store(change: Any, param: str) -> Any:
    """Runs a store change in a thread; an unknown model is a 404, another store error a 400."""
    from baselm.store.errors import StoreError
    from baselm.store.registry import UnknownModelError

    try:
        return await asyncio.to_thread(change)
    except UnknownModelError as exc:
        raise APIError(404, _without_store_path(str(exc)), param) from None
    except StoreError as exc:
        raise bad_request(_without_store_path(str(exc)), param) from None
