"""API-key auth and per-request accounting, as one ASGI middleware around the app.

The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
(Anthropic's). A refusal on the Anthropic routes has Anthropic's error body.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baselm.api.errors import body_for_path
from baselm.api.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})  # load balancers probe this without a key
KNOWN_ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
    | {"/v1/models", "/v1/embeddings", "/tokenize", "/detokenize", "/health", "/metrics", "/"}
    | {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/show", "/api/ps"}
    | {"/api/version", "/api/pull"}
)
_PREFIXED = ("/v1/models/", "/v1/responses/")  # counted as "<prefix>{id}"


def is_authorized(header: str | None, api_key: str) -> bool:
    """True when `header` is `Bearer <api_key>`; compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), api_key.encode())


class Gate:
    """Refuses requests without the API key (when one is set) and counts responses by status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        prefix = next((p for p in _PREFIXED if path.startswith(p)), None)
        endpoint = path if path in KNOWN_ENDPOINTS else f"{prefix}{{id}}" if prefix else "other"
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path not in OPEN_PATHS and not self._authorized(scope):
                await _unauthorized(counting_send, path)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_request(endpoint, status[0])

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return is_authorized(value.decode("latin-1"), self.api_key)
            if name == b"x-api-key":
                return hmac.compare_digest(value.strip(), self.api_key.encode())
        return False


async def _unauthorized(send: Send, path: str) -> None:
    message = "missing or invalid API key; send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
    body = json.dumps(body_for_path(path)(401, message, code="invalid_api_key")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"www-authenticate", b"Bearer"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
