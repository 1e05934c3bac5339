"""llama-server's LoRA routes over the adapters the served model runs per request (`base serve MODEL
--lora NAME=PATH[:scale]`, baselm/served_adapters.py).

`GET /lora-adapters` lists them, `[{"id", "name", "path", "scale"}]`, where `scale` is the default
scale a request that names no adapter runs with (0: off, until set). `POST /lora-adapters` with
`[{"id", "scale"}]` sets those defaults, every adapter not listed at 0, and answers
`{"success": true}`. A request's own `lora` field (chat and completions) and naming an adapter as
the model both go before the defaults.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from baselm.adapters import AdapterError
from baselm.api.errors import bad_request
from baselm.api.pool import pool_of
from baselm.api.schemas import read_lora
from baselm.api.serving import read_json
from baselm.served_adapters import ServedAdapters


def _served(request: Request) -> ServedAdapters | None:
    """The adapters of the loaded model that serves some (only a model served alone takes --lora)."""
    return next(
        (e.state.served_adapters for e in pool_of(request).loaded() if e.state.served_adapters is not None),  # type: ignore[union-attr]
        None,
    )


async def list_adapters(request: Request) -> Response:
    """GET /lora-adapters."""
    served = _served(request)
    return JSONResponse(served.describe() if served is not None else [])


async def set_adapters(request: Request) -> Response:
    """POST /lora-adapters: the default scales; a 400 naming an id no adapter has."""
    scales = read_lora(await read_json(request, request.app.state.base), "lora")
    served = _served(request)
    if served is None:
        if scales:
            raise bad_request("this server serves no LoRA adapters (base serve MODEL --lora NAME=PATH)")
        return JSONResponse({"success": True})
    try:
        served.set_default_scales(scales)
    except AdapterError as exc:
        raise bad_request(str(exc)) from None
    return JSONResponse({"success": True})
