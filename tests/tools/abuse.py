"""A bad client: the requests `soak.py` sends a real server before its load, each of which must be
refused with a 4xx (or, for a huge list that still fits the body limit, answered), never a 5xx or a hang.

Per route: a foreign Host and a foreign Origin; per POST route: a body not declared JSON, one over
the body limit (1 MiB as soak.py serves) and one nested 100,000 deep; huge lists in every list field;
bad logit_bias keys; connections that trickle their headers or body (each must get a 408); and
clients that vanish mid-answer on each API, streamed and whole.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Report:
    """Each check's verdict (printed as it is made), counts of answers by phase, and the run's figures."""

    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    abuse: Counter = field(default_factory=Counter)
    soak: Counter = field(default_factory=Counter)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _huge_lists(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(field, path, body): a body per list field, each with far more entries than any client needs (under 1 MiB)."""
    message = {"role": "user", "content": "x"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = "/v1/chat/completions"
    return [
        ("messages", chat, {"model": model, "messages": [message] * 20000, "max_tokens": 1}),
        ("tools", chat, {"model": model, "messages": [message], "tools": [tool] * 5000, "max_tokens": 1}),
        ("stop", chat, {"model": model, "messages": [message], "stop": ["x"] * 20000}),
        ("logit_bias", chat, {"model": model, "messages": [message], "logit_bias": {str(i): 1 for i in range(30000)}}),
        (
            "content parts",
            chat,
            {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 20000}]},
        ),
        ("prompts", "/v1/completions", {"model": model, "prompt": [[1]] * 50000, "max_tokens": 1}),
        ("prompt ids", "/v1/completions", {"model": model, "prompt": [1] * 200000, "max_tokens": 1}),
        ("input items", "/v1/responses", {"model": model, "input": [message] * 20000, "max_output_tokens": 16}),
        ("messages", "/v1/messages", {"model": model, "messages": [message] * 20000, "max_tokens": 1}),
        ("messages", "/v1/messages/count_tokens", {"model": model, "messages": [message] * 20000}),
        ("input", "/v1/embeddings", {"model": model, "input": ["x"] * 50000}),
        ("input ids", "/v1/embeddings", {"model": model, "input": [[1]] * 50000}),
        ("messages", "/api/chat", {"model": model, "messages": [message] * 20000, "stream": False}),
        ("input", "/api/embed", {"model": model, "input": ["x"] * 50000}),
        ("prompt", "/tokenize", {"prompt": "x " * 300000}),
        ("tokens", "/detokenize", {"tokens": [1] * 150000}),
    ]


def _post(http: httpx.Client, path: str, **kwargs: Any) -> httpx.Response | None:
    """The answer, or None when none came (a timeout, a closed connection)."""
    try:
        return http.post(path, **kwargs)
    except httpx.HTTPError:
        return None


def _expect_4xx(report: Report, what: str, answer: httpx.Response | None, answered_ok: bool = False) -> None:
    status = answer.status_code if answer is not None else 0
    report.abuse[f"{status // 100}xx" if status else "no answer"] += 1
    if not (400 <= status < 500 or (answered_ok and status == 200)):
        report.check(f"abuse: {what}", False, f"answered {status or 'nothing'}")


def every_route(model: str) -> list[tuple[str, str]]:
    """(method, path) of every route the server has, path parameters filled in (`model` for a model's)."""
    from baselm.api.app import ROUTES

    pairs = []
    for route in ROUTES:
        path = route.path.replace("{response_id}", "resp_x").replace("{model:path}", model)
        pairs += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return pairs


def hostile_headers(http: httpx.Client, report: Report, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    for method, path in every_route(model):
        for name, headers in [
            ("foreign Host", {"Host": "rebound.example"}),
            ("foreign Origin", {"Origin": "https://evil.example"}),
        ]:
            _expect_4xx(report, f"{name} on {method} {path}", http.request(method, path, content=body, headers=headers))
        if method == "POST":
            plain = http.post(path, content=body, headers={"Content-Type": "text/plain"})
            _expect_4xx(report, f"text/plain on {path}", plain)
            big = http.post(path, content=b"[" + b"1," * 600000 + b"1]", headers={"Content-Type": "application/json"})
            _expect_4xx(report, f"an oversized body on {path}", big)
            deep = http.post(path, content=_nested(100000), headers={"Content-Type": "application/json"})
            _expect_4xx(report, f"a body nested 100,000 deep on {path}", deep)


def bad_fields(http: httpx.Client, report: Report, model: str) -> None:
    for name, path, body in _huge_lists(model):
        # A huge list that still fits the body limit may be a real request (a long /tokenize, a count of many
        # messages): answered or refused, never a 5xx, a hang or a stalled /health.
        answer = _post(http, path, json=body)
        _expect_4xx(report, f"a huge list of {name} on {path}", answer, answered_ok=True)
    for key in ["²", "١٢", "-1", "1e3", " 1", "99999999999999999999"]:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {key: 1}}
        _expect_4xx(report, f"logit_bias key {key!r}", _post(http, "/v1/chat/completions", json=body))


def _head(path: str, length: int) -> bytes:
    """A JSON POST's request line and headers, for a raw socket."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def slow_clients(url: str, report: Report, read_timeout: float) -> None:
    """40 connections that stop halfway through their headers or body; each must be closed by the server."""
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for i in range(40):
        sock = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        else:
            sock.sendall(_head("/api/chat", 500) + b'{"mod')
        socks.append(sock)
    closed = 0
    for sock in socks:
        sock.settimeout(read_timeout * 10)
        try:
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            closed += answer.startswith(b"HTTP/1.1 408 ")
        except OSError:
            pass
        sock.close()
    report.abuse["408 slow clients"] += closed
    if closed != len(socks):
        report.check("abuse: slow clients", False, f"{len(socks) - closed} of {len(socks)} not answered 408")


def vanishing_clients(url: str, model: str) -> None:
    """A client that leaves mid-answer on each API, streamed and whole."""
    port = int(url.rsplit(":", 1)[1])
    prompt = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    bodies = [
        ("/v1/chat/completions", {"messages": prompt, "max_tokens": 400}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400}),
        ("/v1/responses", {"input": prompt, "max_output_tokens": 400}),
        ("/v1/messages", {"messages": prompt, "max_tokens": 400}),
        ("/api/chat", {"messages": prompt, "options": {"num_predict": 400}}),
        ("/api/generate", {"prompt": "Once upon a time", "options": {"num_predict": 400}}),
    ]
    for path, fields in bodies:
        for stream in (True, False):
            body = json.dumps({"model": model, **fields, "stream": stream}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                sock.sendall(_head(path, len(body)) + body)
                if stream:
                    sock.recv(4096)
                else:
                    time.sleep(0.3)


def run(url: str, report: Report, model: str, read_timeout: float) -> None:
    """Every abusive request above against the server at `url`."""
    with httpx.Client(base_url=url, timeout=120) as http:
        hostile_headers(http, report, model)
        bad_fields(http, report, model)
    slow_clients(url, report, read_timeout)
    vanishing_clients(url, model)
