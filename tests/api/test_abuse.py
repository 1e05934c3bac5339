"""A bad client against every route: hostile Host, Origin and Content-Type on each, a body over
the limit on each POST, requests and bodies that trickle in (slowloris), and clients that vanish
mid-answer on every API. Each is refused in the route's own error shape or cut off, and the
server goes on answering /health and returns to idle (no request running, no KV block held)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.api.conftest import MODEL, RunningServer
from tests.tools.abuse import every_route

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
ROUTE_PAIRS = every_route(MODEL)
POST_PATHS = [path for method, path in ROUTE_PAIRS if method == "POST"]


def _message(path: str, answer) -> str:
    """The refusal's sentence, read from the body shape of the API that owns `path`."""
    body = answer.json()
    if path.startswith("/api/"):
        return body["error"]  # Ollama: one string
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"  # Anthropic
        return body["error"]["message"]
    return body["error"]["message"]  # OpenAI


def test_every_route_is_covered():
    assert len(ROUTE_PAIRS) >= 24 and ("POST", "/api/pull") in ROUTE_PAIRS and ("GET", "/metrics") in ROUTE_PAIRS


@pytest.mark.parametrize(("method", "path"), ROUTE_PAIRS)
def test_a_foreign_host_is_refused_on_every_route(server, method, path):
    answer = server.http(headers={"Host": "rebound.example"}).request(method, path, json=CHAT)
    assert answer.status_code == 403
    assert _message(path, answer).startswith("the Host header 'rebound.example' is not this server's address")


@pytest.mark.parametrize(("method", "path"), ROUTE_PAIRS)
def test_a_foreign_origin_is_refused_on_every_route(server, method, path):
    answer = server.http(headers={"Origin": "https://evil.example"}).request(method, path, json=CHAT)
    assert answer.status_code == 403
    assert _message(path, answer).startswith("requests from the web page at https://evil.example are refused")


@pytest.mark.parametrize("path", POST_PATHS)
def test_a_body_not_declared_json_is_refused_on_every_post_route(server, path):
    answer = server.http().post(path, content=json.dumps(CHAT), headers={"Content-Type": "text/plain"})
    assert answer.status_code == 415
    assert _message(path, answer) == "the request body is text/plain; send it as Content-Type: application/json"


@pytest.fixture(scope="module")
def small_body_server() -> Iterator[RunningServer]:
    """A server that takes bodies of at most 1 KiB."""
    running = RunningServer(max_body_bytes=1024)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def quick_server() -> Iterator[RunningServer]:
    """A server that gives a request's headers, and then its body, half a second to arrive."""
    running = RunningServer(read_timeout=0.5)
    yield running
    running.stop()


@pytest.mark.parametrize("path", POST_PATHS)
def test_a_body_over_the_limit_is_refused_on_every_post_route(small_body_server, path):
    body = b"[" + b"1," * 600 + b"1]"
    declared = small_body_server.http().post(path, content=body, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413
    assert _message(path, declared) == f"the request body is {len(body)} bytes; the limit is 1024"
    chunked = small_body_server.http().post(path, content=iter([body[:600], body[600:]]))  # no Content-Length
    assert chunked.status_code == 413
    assert _message(path, chunked) == "the request body is over the limit of 1024 bytes"


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the timeout only bounds a hang)."""
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize(
    "sent",
    [b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"GET /hea", b"G"],
    ids=["headers-cut", "request-line-cut", "one-byte"],
)
def test_headers_that_trickle_in_get_a_408_and_the_connection_closes(quick_server, sent):
    with socket.create_connection(("127.0.0.1", quick_server.port)) as sock:
        sock.sendall(sent)
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert answer.endswith(b"the request's headers did not arrive within 0.5 seconds\n")


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"), ("/api/chat", "ollama")],
)
def test_a_body_that_trickles_in_gets_a_408_in_the_apis_shape_and_the_connection_closes(quick_server, path, shape):
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n"
    with socket.create_connection(("127.0.0.1", quick_server.port)) as sock:
        sock.sendall(head.encode() + b'{"model": "ti')
        answer = _read_until_closed(sock)
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408 ") and b"connection: close" in status.lower()
    message = "the request body did not arrive within 0.5 seconds"
    expected = {
        "openai": {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
        "anthropic": {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
        "ollama": {"error": message},
    }[shape]
    assert json.loads(body) == expected


def test_a_kept_alive_connection_gets_a_fresh_deadline_for_its_next_request(quick_server):
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", quick_server.port)) as sock:
        sock.settimeout(30)
        sock.sendall(request)
        first = b""
        while not first.endswith(b"}"):
            first += sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(request[:20])  # half of the next request, then nothing
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_stream_outlives_the_read_timeout(quick_server):
    """The deadline covers a request's arrival, never its answer: a stream read slowly goes to its end."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with quick_server.http().stream("POST", "/v1/completions", json=body) as answer:
        lines = answer.iter_lines()
        first = next(line for line in lines if line)
        time.sleep(1.0)  # a slow reader: the connection lives past the 0.5 s deadline
        rest = [line for line in lines if line]
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_a_slow_client_holds_nothing_once_refused(quick_server):
    """Twenty connections that trickle bytes are all closed by the deadline; the server answers meanwhile."""
    socks = [socket.create_connection(("127.0.0.1", quick_server.port)) for _ in range(20)]
    for sock in socks:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    assert quick_server.http().get("/health").status_code == 200
    answers = [_read_until_closed(sock) for sock in socks]
    for sock in socks:
        sock.close()
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers)
    assert quick_server.http().get("/health").status_code == 200


LONG = 1500  # tokens: seconds of work, so the client is gone long before the answer could end
# APIs without ignore_eos get a prompt the fixture model answers greedily for LONG tokens with no end of turn
# (Ollama's repeat penalty off, so its answer is the same greedy one).
ENDLESS = "aaaaaaaa"
GREEDY = {"temperature": 0}
OLLAMA = {"options": {"num_predict": LONG, "temperature": 0, "repeat_penalty": 1.0}}
VANISHING = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG, "ignore_eos": True, **GREEDY},
    ),
    "completions": ("/v1/completions", {"prompt": "Once", "max_tokens": LONG, "ignore_eos": True, **GREEDY}),
    "responses": ("/v1/responses", {"input": ENDLESS, "max_output_tokens": LONG, **GREEDY}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": ENDLESS}], "max_tokens": LONG, **GREEDY}),
    "ollama-chat": ("/api/chat", {"messages": [{"role": "user", "content": ENDLESS}], **OLLAMA}),
    "ollama-generate": ("/api/generate", {"prompt": ENDLESS, **OLLAMA}),
}


def _answered(metrics: dict[str, float], path: str, status: int) -> float:
    return metrics.get(f'base_requests_total{{endpoint="{path}",status="{status}",model="tiny"}}', 0.0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", sorted(VANISHING))
def test_a_client_that_vanishes_mid_answer_on_any_api_frees_everything(server, api, stream):
    path, fields = VANISHING[api]
    body = json.dumps({"model": MODEL, **fields, "stream": stream}).encode()
    idle = server.wait_idle()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        first_tokens = idle["base_time_to_first_token_seconds_count"]
        server.wait_until(lambda m: m["base_time_to_first_token_seconds_count"] > first_tokens, "answering")
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # the stream's head and first events came
    # A stream's status went out with its first event (200); a whole answer's client left before any (499).
    status = 200 if stream else 499
    server.wait_until(lambda m: _answered(m, path, status) > _answered(idle, path, status), f"counting it as {status}")
    metrics = server.wait_idle()
    assert metrics["base_num_requests_running"] == 0 and metrics["base_kv_blocks_used"] == 0
    assert 0 < metrics["base_generation_tokens_total"] - idle["base_generation_tokens_total"] < LONG
    assert server.http().get("/health").status_code == 200


def test_bodies_read_at_once_past_their_budget_get_a_503_before_they_are_read(make_server_with):
    served = make_server_with()
    budget = served.server.config.app.state.base.body_budget
    budget.limit = 3000  # bytes; 64 MiB by default, 4 bodies of --max-body beyond that
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port)) as holder:
        holder.sendall(head.encode() + b'{"model": ')  # 2,000 bytes taken from the budget, 10 of them sent
        served.wait_until(lambda m: budget.num_bytes == 2000, "reading the first body")
        second = served.http().post("/v1/completions", content=b" " * 1990 + b'{"model": "x"}')
        assert second.status_code == 503 and second.headers["Retry-After"] == "1"
        assert second.json()["error"]["message"] == (
            "the server is reading 2000 bytes of other request bodies; retry shortly"
        )
    served.wait_until(lambda m: budget.num_bytes == 0, "done with the first body")
    again = served.http().post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert again.status_code == 200
