"""The chat page of `base serve`: `GET /` in a browser, its files under `/webui/`.

The page is static (static/index.html, its ES modules and styles) and talks to this server's own
OpenAI API from the browser, with the API key the user gives it when one is required. Routes:
- `GET /` answers the page to a request whose Accept names text/html (a browser's navigation) and
  Ollama's plain-text probe to every other (`HEAD /` too), so Ollama's clients see what they did.
- `GET /webui/{path}` the page's files: its own, and the libraries build.py puts in static/vendor/.
Both are public (`is_public`): a browser loads a page before it can send a key, and the files hold
no secret. Every answer carries a Content-Security-Policy that lets the page load and call only this
server, run no inline script and show no remote image, so a model's answer rendered as markdown
cannot run code or send the conversation anywhere.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Scope

from baselm.api.errors import APIError
from baselm.api.ollama.models import ollama_root

STATIC_DIR = Path(__file__).resolve().parent / "static"
FILES_PREFIX = "/webui/"
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",  # data: for the images a message carries (picked, pasted, dropped)
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a reinstalled package serves its new files at once
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".LICENSE": "text/plain; charset=utf-8",
}


def accepts_html(scope: Scope) -> bool:
    """True when the request's Accept header names text/html (a browser opening the page)."""
    accept = next((v for n, v in scope["headers"] if n == b"accept"), b"")
    return b"text/html" in accept.lower()


def is_public(scope: Scope) -> bool:
    """True for the page and its files, which load without the API key."""
    path = scope["path"]
    return path.startswith(FILES_PREFIX) or (path == "/" and scope["method"] == "GET" and accepts_html(scope))


def _file(relative: str) -> Response:
    """The file at `relative` under static/, or a 404 for anything else (a folder, a hidden file, `..`)."""
    path = (STATIC_DIR / relative).resolve()
    content_type = CONTENT_TYPES.get(path.suffix)
    hidden = any(part.startswith(".") for part in Path(relative).parts)
    if content_type is None or hidden or not path.is_relative_to(STATIC_DIR) or not path.is_file():
        raise APIError(404, f"the chat page has no file {relative!r}")
    return FileResponse(path, media_type=content_type, headers=HEADERS)


async def root(request: Request) -> Response:
    """GET /: the page for a browser, Ollama's probe for the rest."""
    if request.method == "GET" and accepts_html(request.scope):
        return _file("index.html")
    return await ollama_root(request)


async def page_file(request: Request) -> Response:
    return _file(request.path_params["path"])


def with_page(routes: list[BaseRoute]) -> list[BaseRoute]:
    """`routes` with the chat page: `/` answers browsers with it, its files are served under /webui/."""
    kept = [route for route in routes if getattr(route, "path", None) != "/"]
    page = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route(FILES_PREFIX + "{path:path}", page_file, methods=["GET", "HEAD"]),
    ]
    return page + kept


__all__ = ["CONTENT_SECURITY_POLICY", "is_public", "with_page"]
