"""API-key auth and per-request accounting (the /metrics counts and the request's log line,
request_log.py), as one ASGI middleware around the app.

The key comes as `Authorization: Bearer <key>` (OpenAI's clients; the scheme in any case, as
RFC 7235 has it) or `x-api-key: <key>` (Anthropic's), compared as UTF-8 bytes in constant time.
NOTE: every credential a request sends must be the key: one wrong credential beside a right one
is refused, whichever header comes first. A refusal on the Anthropic routes has Anthropic's error body.
/health and, with the chat page on, the page and its files (webui.is_public) answer without the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baselm.api import request_log
from baselm.api.errors import APIError, send_error
from baselm.api.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})  # load balancers probe this without a key
KNOWN_ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
    | {"/v1/models", "/v1/embeddings", "/tokenize", "/detokenize", "/health", "/metrics", "/"}
    | {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/show", "/api/ps"}
    | {"/api/version", "/api/pull", "/api/delete", "/api/copy", "/models", "/models/load", "/models/unload"}
)
_PREFIXED = ("/v1/models/", "/v1/responses/", "/webui/")  # counted as "<prefix>{id}"


def _credentials(headers: list[tuple[bytes, bytes]]) -> list[bytes | None]:
    """Every credential among ASGI `headers`, as raw bytes: each `Authorization` header's bearer
    token (None for another scheme, which no key matches) and each `x-api-key`."""
    found: list[bytes | None] = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            found.append(token.strip() if scheme.lower() == b"bearer" else None)
        elif name == b"x-api-key":
            found.append(value.strip())
    return found


def is_authorized(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    """True when the request sends at least one credential and every one is `api_key`."""
    key = api_key.encode("utf-8")
    sent = _credentials(headers)
    matches = [token is not None and hmac.compare_digest(token, key) for token in sent]
    return bool(matches) and all(matches)


class Gate:
    """Refuses requests without the API key (when one is set), counts responses by status and logs
    each request's one line once its response is sent."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: Metrics, is_public: Callable[[Scope], bool] | None = None
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.is_public = is_public or (lambda scope: False)  # requests answered without the key beside /health

    def _is_open(self, scope: Scope) -> bool:
        return scope["path"] in OPEN_PATHS or self.is_public(scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        prefix = next((p for p in _PREFIXED if path.startswith(p)), None)
        endpoint = path if path in KNOWN_ENDPOINTS else f"{prefix}{{id}}" if prefix else "other"
        record = request_log.start(scope)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            if self.api_key and not self._is_open(scope) and not is_authorized(scope["headers"], self.api_key):
                await _unauthorized(counting_send, path)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_request(endpoint, record.status, record.model or "")
            record.write()


async def _unauthorized(send: Send, path: str) -> None:
    message = "missing or invalid API key; send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
    await send_error(send, path, APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
