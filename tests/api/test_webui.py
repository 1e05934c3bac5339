"""The chat page's routes over HTTP: `/` answers browsers with the page and every other client with
Ollama's probe, the page's files have their types and a strict Content-Security-Policy, and they load
without the API key that the API itself needs. The page in a browser: test_webui_browser.py."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from baselm.api.app import create_app
from baselm.api.webui import CONTENT_SECURITY_POLICY
from tests.api.conftest import MODEL, RunningServer

BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
KEY = "sk-page"


@pytest.fixture(scope="module")
def keyed() -> RunningServer:
    server = RunningServer(api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def without_page(server) -> TestClient:
    """The app of `base serve --no-webui` over the running server's engine."""
    return TestClient(create_app(server.client, MODEL, webui=False), base_url="http://127.0.0.1")


def test_a_browser_gets_the_page_with_a_strict_policy(server) -> None:
    page = server.http().get("/", headers=BROWSER)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="/webui/app.js">' in page.text
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"


def test_other_clients_still_get_ollamas_probe(server) -> None:
    for headers in ({}, {"Accept": "*/*"}, {"Accept": "application/json"}):
        probe = server.http().get("/", headers=headers)
        assert probe.status_code == 200 and probe.text.startswith("base is running")
    head = server.http().head("/", headers=BROWSER)
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    ("path", "content_type"),
    [("app.js", "text/javascript"), ("api.js", "text/javascript"), ("style.css", "text/css")],
)
def test_the_pages_files_have_their_types(server, path, content_type) -> None:
    answer = server.http().get(f"/webui/{path}")
    assert answer.status_code == 200 and answer.headers["content-type"] == f"{content_type}; charset=utf-8"
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


@pytest.mark.parametrize("path", ["nothing.js", "vendor/.package-lock.sha256", "..%2Fwebui%2F__init__.py", "vendor"])
def test_nothing_else_is_served_from_the_pages_folder(server, path) -> None:
    assert server.http().get(f"/webui/{path}").status_code == 404


def test_the_page_loads_without_the_key_the_api_needs(keyed) -> None:
    http = keyed.http()
    assert http.get("/", headers=BROWSER).status_code == 200
    assert http.get("/webui/app.js").status_code == 200
    assert http.get("/v1/models").status_code == 401
    assert http.get("/").status_code == 401  # Ollama's probe keeps asking for the key, as before
    assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_no_webui_leaves_root_to_ollama(without_page) -> None:
    http = without_page
    assert http.get("/", headers=BROWSER).text.startswith("base is running")
    assert http.get("/webui/app.js").status_code == 404


def test_the_browser_guard_lets_the_pages_own_calls_through(server) -> None:
    # What Chromium sends for the page's fetch: its own origin, JSON.
    own = {"Origin": server.url, "Content-Type": "application/json"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert server.http().post("/v1/chat/completions", json=body, headers=own).status_code == 200
    foreign = {"Origin": "http://evil.example", "Content-Type": "application/json"}
    assert server.http().post("/v1/chat/completions", json=body, headers=foreign).status_code == 403
