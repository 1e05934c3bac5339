"""A pytest plugin that points llama.cpp's server tests (tools/server/tests) at a running `base serve`.

llama.cpp's tests talk to their own server: paths without the /v1 prefix, any model name. This
plugin adapts them from the outside, without changing a test: OpenAI paths get /v1, and every
JSON body that names a model (or should) names the served one. `DEBUG_EXTERNAL=1` and `PORT`
make the tests use the running server instead of starting theirs; `BASE_PEER_MODEL` is its name.
Response header names reach the tests in their conventional capitalization.
"""

from __future__ import annotations

import json
import os
import sys
import types

import httpx
import requests

MODEL = os.environ["BASE_PEER_MODEL"]
# llama.cpp serves these with and without /v1; without, they are its own (e.g. /completions, /tokenize).
OPENAI_PATHS = ("/chat/completions", "/models", "/embeddings", "/responses", "/messages")

# utils.py imports wget to download models, which an external server does not need.
sys.modules.setdefault("wget", types.ModuleType("wget"))


def _openai_path(path: str) -> str | None:
    """The /v1 path for an OpenAI route given without the prefix; None for anything else."""
    if path.startswith("/v1/"):
        return path
    if path in OPENAI_PATHS or path.startswith("/models/"):
        return "/v1" + path
    return None


def _named(data: object) -> object:
    return {**data, "model": MODEL} if isinstance(data, dict) else data


_request = requests.sessions.Session.request


def _adapted_request(self, method, url, *args, **kwargs):
    parsed = requests.utils.urlparse(url)
    path = _openai_path(parsed.path)
    if path is not None:
        url = parsed._replace(path=path).geturl()
        if "json" in kwargs:
            kwargs["json"] = _named(kwargs["json"])
    response = _request(self, method, url, *args, **kwargs)
    # Header names are case-insensitive and this server sends them in lower case; their tests copy
    # them into a plain dict and look them up as "Access-Control-Allow-Origin".
    response.headers = requests.structures.CaseInsensitiveDict({k.title(): v for k, v in response.headers.items()})
    return response


def _adapt_sends(http) -> None:
    """Patches `http.Client.send` (httpx, or the fork newer openai clients use) the same way."""
    send = http.Client.send

    def adapted_send(self, request, **kwargs):
        path = _openai_path(request.url.path)
        if path is not None:
            is_json = request.content and "json" in request.headers.get("content-type", "")
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            url = request.url.copy_with(path=path)
            if is_json:
                request = http.Request(request.method, url, headers=headers, json=_named(json.loads(request.content)))
            else:
                request = http.Request(request.method, url, headers=headers, content=request.content)
        return send(self, request, **kwargs)

    http.Client.send = adapted_send


requests.sessions.Session.request = _adapted_request
_adapt_sends(httpx)
try:
    import httpx2
except ImportError:
    pass
else:
    _adapt_sends(httpx2)
