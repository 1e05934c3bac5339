"""CPU-heavy work of a route runs off the event loop: while one request tokenizes or compiles a
grammar, the server still answers others (`/health` here).

Each test holds the heavy step inside a patched call until `/health` has answered; were that step on
the event loop, `/health` could not answer and its request would time out, failing the test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.api.conftest import MODEL

WAIT = 30.0  # bounds only a test that would otherwise hang


class Held:
    """A call that, once entered, waits for `release` before doing its work."""

    def __init__(self, work: Callable[..., Any]) -> None:
        self.work = work
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        if not self.release.wait(WAIT):
            raise RuntimeError("the held call was never released")
        return self.work(*args, **kwargs)


@pytest.fixture
def answer_health_while_held(server) -> Iterator[Callable[[Held, str, dict[str, Any]], httpx.Response]]:
    def run(held: Held, path: str, body: dict[str, Any]) -> httpx.Response:
        answers: list[httpx.Response] = []
        request = threading.Thread(target=lambda: answers.append(server.http().post(path, json=body)))
        request.start()
        try:
            assert held.entered.wait(WAIT), f"{path} never reached the held call"
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 200
        finally:
            held.release.set()
            request.join(WAIT)
        return answers[0]

    yield run


def test_health_answers_while_tokenize_encodes(server, monkeypatch, answer_health_while_held):
    tokenizer = server.engine.tokenizer
    held = Held(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", held)
    answer = answer_health_while_held(held, "/tokenize", {"prompt": "hello"})
    assert answer.status_code == 200 and answer.json()["count"] > 0


def test_health_answers_while_detokenize_decodes(server, monkeypatch, answer_health_while_held):
    tokenizer = server.engine.tokenizer
    held = Held(tokenizer.decode)
    monkeypatch.setattr(tokenizer, "decode", held)
    answer = answer_health_while_held(held, "/detokenize", {"tokens": [1, 2, 3]})
    assert answer.status_code == 200 and isinstance(answer.json()["prompt"], str)


def test_health_answers_while_ollama_compiles_a_format_grammar(server, monkeypatch, answer_health_while_held):
    import baselm.api.constrained as constrained

    held = Held(constrained.check_grammar)
    monkeypatch.setattr(constrained, "check_grammar", held)
    body = {"model": MODEL, "prompt": "hi", "format": "json", "stream": False, "options": {"num_predict": 1}}
    answer = answer_health_while_held(held, "/api/generate", body)
    assert answer.status_code == 200
    server.wait_idle()
