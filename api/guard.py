"""What a web page the user opens may not make this server do, checked before auth's routes run.

A browser lets any page send a simple request (GET, or a POST of text/plain, a form or
multipart) to a server on loopback without asking it first, and DNS rebinding lets the page
read the answer under a name of its own. So, like the local servers browsers share a machine
with, every request is refused:

1. a 403 when its Host is not this server's: the bound address, `localhost`, `127.0.0.1` or
   `[::1]` on any port, or a name in `--allowed-hosts` ("*": any). A server bound to a
   non-loopback address (0.0.0.0, ::, a LAN address) was exposed on purpose and takes any
   Host unless `--allowed-hosts` names them; an API key guards it.
2. a 403 when it carries an Origin other than the server's own that `--cors-origins` does not
   allow (CORS alone only hides the answer from the page; the request would still have run).
3. a 415 when it POSTs a body declared as anything but application/json. A body with no
   Content-Type is read as JSON (some clients send none; a browser's comes with an Origin).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from baselm.api.cors import is_allowed_origin
from baselm.api.errors import APIError, send_error

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON = "application/json"


def host_name(host: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    """True when the address `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_names(bound: str, allowed: Sequence[str]) -> frozenset[str] | None:
    """The Host names a server bound to `bound` answers; None: any (`*`, or a non-loopback bind
    given no `--allowed-hosts`)."""
    if "*" in allowed or (not is_loopback(bound) and not allowed):
        return None
    return LOOPBACK_NAMES | {host_name(bound)} | {host_name(h) for h in allowed}


def _header(scope: Scope, name: bytes) -> str | None:
    value = next((v for n, v in scope["headers"] if n == name), None)
    return None if value is None else value.decode("latin-1")


def refusal(scope: Scope, host_names: frozenset[str] | None, cors_origins: Sequence[str]) -> APIError | None:
    """Why the request in `scope` is refused, or None when it may run."""
    host = _header(scope, b"host")
    name = host_name(host) if host is not None else None
    if host_names is not None and name is not None and name not in host_names:
        return APIError(
            403,
            f"the Host header {name!r} is not this server's address; "
            f"start it with --allowed-hosts {name} to accept that name",
        )
    origin = _header(scope, b"origin")
    own = {f"http://{host}", f"https://{host}"} if host is not None else set()
    if origin is not None and origin not in own and not is_allowed_origin(origin, cors_origins):
        return APIError(
            403,
            f"requests from the web page at {origin} are refused; "
            f"start the server with --cors-origins {origin} to let that page call it",
        )
    content_type = _header(scope, b"content-type")
    declared = (content_type or "").split(";", 1)[0].strip().lower()
    if scope["method"] == "POST" and content_type is not None and declared != JSON:
        return APIError(415, f"the request body is {declared or 'untyped'}; send it as Content-Type: {JSON}")
    return None


class BrowserGuard:
    """Refuses, before the route runs, what only a foreign web page would send (see the module docstring)."""

    def __init__(self, app: ASGIApp, host_names: frozenset[str] | None, cors_origins: Sequence[str]) -> None:
        self.app = app
        self.host_names = host_names
        self.cors_origins = tuple(cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = refusal(scope, self.host_names, self.cors_origins) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await send_error(send, scope["path"], error)
