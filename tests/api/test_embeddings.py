"""Embeddings beside generation: many inputs run a slice at a time between steps, a request holds
at most MAX_INPUTS inputs on every route, and a client that leaves drops the work not done."""

from __future__ import annotations

import json
import socket
import time

import ollama
import pytest

from baselm.embedding import MAX_INPUTS
from baselm.sampling.params import SamplingParams
from tests.api.conftest import MODEL, RunningServer

BUDGET = 16  # max_num_batched_tokens, and the block size: an input of BUDGET ids is one slice of one block
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server():
    running = RunningServer(max_num_batched_tokens=BUDGET, block_size=BUDGET)
    yield running
    running.stop()


def on_engine(server: RunningServer, fn):
    """`fn(engine)` run on the engine thread, between steps, and its result."""
    return server.client.call(fn).result(timeout=60)


def poll(server: RunningServer, fn, until, what: str):
    """`fn(engine)`'s result once `until` holds for it; fails the test after a generous minute."""
    deadline = time.monotonic() + 60
    while True:
        value = on_engine(server, fn)
        if until(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within 60 s; last reading: {value}")
        time.sleep(0.01)


def completion_tokens(engine) -> int | None:
    """The output tokens of the one request running so far; None when there is none."""
    requests = list(engine.scheduler.requests.values())
    return requests[0].num_output_tokens if requests else None


def test_a_running_completion_gains_a_token_for_every_slice_of_an_embedding(server) -> None:
    num_inputs = 200  # one slice each
    inputs = [[5 + i % 100] * BUDGET for i in range(num_inputs)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request_id = on_engine(server, lambda engine: engine.add_request([5, 9, 17, 3], params))
    try:
        result = server.openai().embeddings.create(model=MODEL, input=inputs)
        num_tokens = on_engine(server, completion_tokens) or MAX_TOKENS  # None: it finished
    finally:
        on_engine(server, lambda engine: engine.abort(request_id))
    assert len(result.data) == num_inputs
    # The engine thread steps the completion after each slice: it cannot fall behind the embedding.
    assert num_tokens >= num_inputs


def slices_done(server: RunningServer) -> list[int]:
    return [r.num_slices_done for r in server.client.embeddings.requests.values()]


def test_a_client_that_disconnects_mid_embedding_leaves_no_work_behind(server) -> None:
    pool_size = on_engine(server, lambda engine: engine.kv_manager.pool.num_blocks)
    held = on_engine(server, lambda engine: engine.kv_manager.pool.allocate(engine.kv_manager.pool.num_free_blocks - 2))
    try:
        # Three one-block slices run; the last input needs 4 blocks, and only 2 are free.
        body = json.dumps({"model": MODEL, "input": [[5] * BUDGET] * 3 + [[6] * (4 * BUDGET)]}).encode()
        head = "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert poll(server, lambda _: slices_done(server), lambda done: done == [3], "three slices") == [3]
        poll(server, lambda _: slices_done(server), lambda done: done == [], "the embedding's abort")
    finally:
        on_engine(server, lambda engine: engine.kv_manager.pool.free(held))
    assert on_engine(server, lambda engine: engine.kv_manager.pool.num_free_blocks) == pool_size
    assert len(server.openai().embeddings.create(model=MODEL, input=["still serving"]).data) == 1


def test_every_route_refuses_more_inputs_than_the_limit_in_its_own_shape(server) -> None:
    too_many = ["a"] * MAX_INPUTS + [{"not": "a string"}]  # counted before any item is read
    limit = f"the limit is {MAX_INPUTS} per request"
    with server.http() as http:
        openai_style = http.post("/v1/embeddings", json={"model": MODEL, "input": too_many})
        assert openai_style.status_code == 400
        error = openai_style.json()["error"]
        assert limit in error["message"] and error["param"] == "input" and error["type"] == "invalid_request_error"
        ollama_style = http.post("/api/embed", json={"model": MODEL, "input": ["a"] * (MAX_INPUTS + 1)})
        assert ollama_style.status_code == 400 and limit in ollama_style.json()["error"]
        older = http.post("/api/embeddings", json={"model": MODEL, "prompt": ["a"] * (MAX_INPUTS + 1)})
        assert older.status_code == 400 and "prompt must be a string" in older.json()["error"]  # one prompt only
    with pytest.raises(ollama.ResponseError, match=limit):
        ollama.Client(host=server.url, timeout=60).embed(model=MODEL, input=["a"] * (MAX_INPUTS + 1))
    assert len(server.openai().embeddings.create(model=MODEL, input=["a"] * MAX_INPUTS).data) == MAX_INPUTS


def test_one_array_of_ids_is_one_input_however_long(server) -> None:
    with server.http() as http:
        answer = http.post("/v1/embeddings", json={"model": MODEL, "input": [5] * (MAX_INPUTS + 1)})
    assert answer.status_code == 400
    assert f"an input has {MAX_INPUTS + 1} tokens" in answer.json()["error"]["message"]
