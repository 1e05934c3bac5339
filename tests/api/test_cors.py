"""CORS for browser clients: off by default; with --cors-origins, preflights and answers carry the headers."""

from __future__ import annotations

from tests.api.conftest import MODEL

PAGE = "http://localhost:3000"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_without_cors_origins_a_page_is_refused_without_cors_headers(server):
    http = server.http()
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    answer = http.post("/v1/chat/completions", json=BODY, headers={"Origin": PAGE})
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers


def test_allowed_origins_get_preflights_answered_without_a_key_and_headers_on_answers(make_server_with):
    served = make_server_with(api_key="sk-test", cors_origins=(PAGE,))
    http = served.http()
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = http.post("/v1/chat/completions", json=BODY, headers={"Origin": PAGE, "Authorization": "Bearer sk-test"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
    refused = http.post("/v1/chat/completions", json=BODY, headers={"Origin": PAGE})  # no key: the page can read why
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE


def test_the_localhost_keyword_allows_pages_from_this_machine_on_any_port(make_server_with):
    http = make_server_with(cors_origins=("localhost",)).http()
    for origin in ("http://localhost", "http://127.0.0.1:3000", "http://[::1]:8080", "https://localhost:5173"):
        answer = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": origin})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    for origin in ("http://localhost.evil.com", "http://notlocalhost", "http://evil.com"):
        answer = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": origin})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_preflight_from_another_origin_is_answered_without_cors_headers(make_server_with):
    """The browser refuses the call; the foreign page learns nothing of what the server allows."""
    http = make_server_with(api_key="sk-test", cors_origins=(PAGE,)).http()
    other = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert other.status_code == 200
    assert not [name for name in other.headers if name.lower().startswith("access-control-")]
    allowed = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert allowed.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
