"""OpenAI-style errors: one exception type for every refusal, one JSON body for every status.

Every error the server returns has the body `{"error": {"message", "type", "param", "code"}}`,
except on the Anthropic Messages routes, which answer in Anthropic's
`{"type": "error", "error": {"type", "message"}}`.
Validation mistakes are 400s (never a framework's 422), unknown routes 404, and only a real
bug is a 500, whose body says so without a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

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


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**(error.headers or {}), **(headers or {})}
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(exc.status_code, message), exc.status_code, headers=exc.headers)
    return error_response(APIError(exc.status_code, message), headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, "the server hit an internal error; the request was not completed"))


EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
