"""One log line per request (api/request_log.py): what a real server logs for each request a real client sends."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from baselm.api.request_log import JSONFormatter, line_text
from tests.api.conftest import MODEL, RunningServer

ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    """A server of its own: no other test's requests among its lines."""
    running = RunningServer()
    yield running
    running.stop()


@pytest.fixture
def request_lines(server, caplog):
    """A function that returns the request lines logged so far. It asks GET /health last and waits for
    that line: the server writes a request's line after sending its response, so a client may read the
    answer before the line is written, but not before the next request's."""
    caplog.set_level(logging.DEBUG, logger="baselm.api.requests")

    def lines(timeout: float = 30.0) -> list[logging.LogRecord]:
        httpx.get(f"{server.url}/health", timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            records = [r for r in caplog.records if r.name == "baselm.api.requests"]
            if records and records[-1].fields["route"] == "/health" or time.monotonic() > deadline:
                return records[:-1]
            time.sleep(0.01)

    return lines


def test_a_chat_request_logs_one_line_with_its_token_counts(server, request_lines):
    done = server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    [record] = request_lines()
    fields = record.fields
    assert {k: fields[k] for k in ("method", "route", "status", "model", "finish_reason")} == {
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
        "model": MODEL,
        "finish_reason": done.choices[0].finish_reason,
    }
    assert (fields["prompt_tokens"], fields["cached_tokens"], fields["generated_tokens"]) == (
        done.usage.prompt_tokens,
        done.usage.prompt_tokens_details.cached_tokens,
        done.usage.completion_tokens,
    )
    assert fields["ttft_ms"] > 0 and fields["duration_ms"] >= fields["ttft_ms"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == line_text(fields)
    assert f"POST /v1/chat/completions 200 {MODEL}: {done.usage.prompt_tokens} prompt tokens" in record.getMessage()


def test_a_streamed_request_logs_one_line_after_its_last_chunk(server, request_lines):
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    [record] = request_lines()
    assert (record.fields["generated_tokens"], record.fields["prompt_tokens"]) == (
        usage.completion_tokens,
        usage.prompt_tokens,
    )
    assert record.fields["finish_reason"] in ("stop", "length")


def test_each_protocol_logs_its_route_once(server, request_lines):
    with server.http() as http:
        http.post(
            "/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 3}}
        )
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2})
    records = request_lines()
    assert [(r.fields["route"], r.fields["generated_tokens"] <= 6) for r in records] == [
        ("/api/generate", True),
        ("/v1/completions", True),
    ]


def test_a_refused_request_logs_its_status_and_no_generation(server, request_lines):
    with server.http() as http:
        assert http.post("/v1/chat/completions", json={"model": "nope", "messages": ASK}).status_code == 404
    [refused] = request_lines()
    assert refused.fields["status"] == 404 and "model" not in refused.fields
    assert refused.getMessage().startswith("POST /v1/chat/completions 404, ")


def test_probes_log_at_debug_only(server, request_lines):
    httpx.get(f"{server.url}/metrics", timeout=30)
    [metrics] = request_lines()
    assert (metrics.fields["route"], metrics.levelno) == ("/metrics", logging.DEBUG)


def test_the_json_format_writes_the_fields_as_keys():
    record = logging.LogRecord("baselm.api.requests", logging.INFO, __file__, 1, "%s", ("the line",), None)
    record.fields = {"route": "/v1/models", "status": 200}
    entry = json.loads(JSONFormatter().format(record))
    assert {k: entry[k] for k in ("level", "logger", "message", "route", "status")} == {
        "level": "info",
        "logger": "baselm.api.requests",
        "message": "the line",
        "route": "/v1/models",
        "status": 200,
    }
