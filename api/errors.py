"""OpenAI-style errors: one exception type for every refusal, one JSON body for every status.

Every error the server returns has the body `{"error": {"message", "type", "param", "code"}}`,
except under the routes of another protocol, which answer in its shape (`ERROR_SHAPES`): Ollama's
`{"error": "..."}` under /api/, Anthropic's `{"type": "error", "error": {"type", "message"}}` under
/v1/messages.
Validation mistakes are 400s (never a framework's 422), unknown routes 404, and only a real
bug is a 500, whose body says so without a traceback. The engine refuses a request's field with
its own errors (`FIELD_ERRORS`: a grammar that cannot be enforced, tools the model cannot serve),
each answered as the 400 naming that field (`api_error`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Send

from baselm.distributed.group import RankFailedError
from baselm.structured.errors import StructuredOutputError
from baselm.toolcalls.errors import ToolCallError

logger = logging.getLogger("baselm.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A refused request: the HTTP status, one sentence for the caller, and the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# The engine's refusals of one field of a request; each carries the field as `param`.
FIELD_ERRORS = (StructuredOutputError, ToolCallError)


def api_error(exc: APIError | StructuredOutputError | ToolCallError) -> APIError:
    """The refusal `exc` as the APIError it is answered with (an engine's: a 400 naming its field)."""
    return exc if isinstance(exc, APIError) else bad_request(exc.message, exc.param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # routes that answer refusals in Anthropic's body


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for a refusal with HTTP `status`."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _anthropic_shape(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return anthropic_error_body(status, message)


def ollama_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Ollama's error body: one string."""
    return {"error": message}


# Routes under these path prefixes answer errors in their own protocol's shape; the rest in OpenAI's.
ERROR_SHAPES: tuple[tuple[str, Callable[..., dict[str, Any]]], ...] = (
    ("/api/", ollama_error_body),
    (ANTHROPIC_PATHS, _anthropic_shape),
)


def body_for_path(path: str) -> Callable[..., dict[str, Any]]:
    """The error body builder of the protocol that owns `path`."""
    return next((shape for prefix, shape in ERROR_SHAPES if path.startswith(prefix)), error_body)


async def send_error(send: Send, path: str, error: APIError) -> None:
    """Answers `error` straight from an ASGI middleware, in the body of the protocol that owns `path`."""
    body = json.dumps(body_for_path(path)(error.status, error.message, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response(error: APIError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    headers = {**(error.headers or {}), **(headers or {})}
    body = body_for_path(path)(error.status, error.message, error.param, error.code)
    return JSONResponse(body, error.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc, path=request.url.path)


async def _field_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FIELD_ERRORS)
    return error_response(api_error(exc), path=request.url.path)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(APIError(exc.status_code, message), headers=exc.headers, path=request.url.path)


def rank_failed(exc: RankFailedError) -> APIError:
    """A rank of a tensor-parallel model died or hung: the server cannot compute until restarted."""
    return APIError(503, f"the model is unavailable: {exc}")


async def _rank_failed(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RankFailedError)
    return error_response(rank_failed(exc), path=request.url.path)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    error = APIError(500, "the server hit an internal error; the request was not completed")
    return error_response(error, path=request.url.path)


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    StructuredOutputError: _field_error,
    ToolCallError: _field_error,
    HTTPException: _http_error,
    RankFailedError: _rank_failed,
    Exception: _server_error,
}
