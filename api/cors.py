"""CORS for browser clients: which web origins may call the API, and how their preflights are answered."""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

# "localhost" in --cors-origins: any page served from this machine, on any port.
LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def is_allowed_origin(origin: str, origins: Sequence[str]) -> bool:
    """True when `--cors-origins` (`origins`) lets the page at `origin` call the API."""
    if "*" in origins or origin in origins:
        return True
    return "localhost" in origins and re.fullmatch(LOOPBACK_ORIGIN, origin) is not None


class OriginCORS(CORSMiddleware):
    """Starlette's CORS, except that a preflight from an origin not allowed is a plain 200 without
    CORS headers (as llama.cpp and most servers answer it): the browser refuses the call either way,
    and the foreign page learns nothing of what the server allows."""

    def preflight_response(self, request_headers: Headers) -> Response:
        if not self.is_allowed_origin(origin=request_headers["origin"]):
            return Response(status_code=200)
        return super().preflight_response(request_headers)


def cors_middleware(origins: Sequence[str]) -> Middleware:
    """The middleware for `--cors-origins` ("*": any origin; "localhost": pages from this machine)."""
    return Middleware(
        OriginCORS,
        allow_origins=[o for o in origins if o != "localhost"],
        allow_origin_regex=LOOPBACK_ORIGIN if "localhost" in origins else None,
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        max_age=600,
    )
