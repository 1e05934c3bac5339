"""Server-sent events as OpenAI streams them: `data: {json}\n\n` chunks, then `data: [DONE]\n\n`.

`EventStream` is a small ASGI response that watches the connection while it streams: when
the client goes away the stream is cancelled at once, so the request's generator runs its
cleanup (which aborts the engine request) without waiting for the next token to fail to send.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Scope, Send

from baselm.api.errors import APIError, error_body, logger, rank_failed
from baselm.distributed.group import RankFailedError

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_event(name: str, payload: dict[str, Any]) -> str:
    """An event with its type on an `event:` line, as the Responses and Anthropic Messages streams send them."""
    return f"event: {name}\n{event(payload)}"


def stream_error(exc: Exception) -> APIError:
    """The APIError to tell of `exc`, raised while streaming; anything else is logged as a bug."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RankFailedError):
        return rank_failed(exc)
    logger.exception("internal error while streaming", exc_info=exc)
    return APIError(500, "the server hit an internal error while streaming")


def error_event(exc: Exception) -> str:
    """An error after the headers went out can only be an event: the OpenAI error body, no traceback."""
    error = stream_error(exc)
    return event(error_body(error.status, error.message, error.param, error.code))


class EventStream:
    """Streams `events` (already formatted) as text/event-stream; cancels them on disconnect."""

    def __init__(self, events: AsyncIterator[str], media_type: str = "text/event-stream") -> None:
        self.events = events
        self.media_type = media_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", f"{self.media_type}; charset=utf-8".encode()),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        task = asyncio.current_task()
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected.is_set():
                raise
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            await self.events.aclose()
