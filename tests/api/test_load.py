"""Many streams at once, and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest

from tests.api.conftest import MODEL


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: tell me about {'abcdefgh'[i % 8] * (1 + i % 5)}"}]


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
    text, reason = "", ""
    stream = await client.chat.completions.create(
        model=MODEL, messages=_prompt(i), max_tokens=10 + i % 7, temperature=0, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_32_parallel_streams_match_sequential_answers_and_the_server_returns_to_idle(server):
    async def run() -> tuple[list, list]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        sequential = [await _stream(client, i) for i in range(32)]
        parallel = await asyncio.gather(*(_stream(client, i) for i in range(32)))
        await client.close()
        return sequential, list(parallel)

    sequential, parallel = asyncio.run(run())
    assert parallel == sequential
    assert all(reason in ("stop", "length") for _, reason in parallel)
    metrics = server.wait_idle()
    assert metrics["base_num_requests_running"] == 0
    assert metrics["base_num_requests_waiting"] == 0
    assert metrics["base_kv_blocks_used"] == 0
    assert metrics["base_time_to_first_token_seconds_count"] >= 64
    assert metrics["base_inter_token_latency_seconds_count"] > 0


def test_a_client_that_leaves_mid_stream_frees_its_blocks_and_others_go_on(server):
    server.wait_idle()
    client = server.openai()
    long = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True}, stream=True)
    # The stayer must still run when the leaver's abort has landed: 1500 tokens take seconds, not milliseconds.
    stayer_max_tokens = 1500
    leaver = client.chat.completions.create(messages=_prompt(1), max_tokens=400, **long)
    stayer = client.chat.completions.create(messages=_prompt(2), max_tokens=stayer_max_tokens, **long)
    leaver_chunks = iter(leaver)
    for _ in range(5):
        next(leaver_chunks)
    stayer_chunks = iter(stayer)
    next(stayer_chunks)  # the stayer is queued (its first chunk comes once the engine took it)
    leaver.close()

    # Both were queued, so one running and none waiting means the leaver is gone and the stayer runs.
    during = server.wait_until(
        lambda m: m["base_num_requests_running"] == 1 and m["base_num_requests_waiting"] == 0,
        "running the staying stream alone",
    )
    assert during["base_num_requests_running"] == 1
    # Only the staying stream holds blocks: its prompt and at most its max_tokens new tokens, 16 per block.
    stayer_prompt = len(server.engine.tokenizer.encode_chat(_prompt(2)))
    assert 0 < during["base_kv_blocks_used"] <= -(-(stayer_prompt + stayer_max_tokens) // 16)

    text, reason = "", ""
    for chunk in stayer_chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert reason == "length" and text
    after = server.wait_idle()
    assert after["base_kv_blocks_used"] == 0 and after["base_num_requests_running"] == 0


def _count_499(metrics: dict[str, float]) -> float:
    return sum(
        value for name, value in metrics.items() if name.startswith("base_requests_total{") and 'status="499"' in name
    )


def test_a_client_that_leaves_before_a_whole_answer_aborts_it(server):
    idle = server.wait_idle()
    before = idle["base_generation_tokens_total"]
    body = json.dumps({"model": MODEL, "messages": _prompt(3), "max_tokens": 1500, "ignore_eos": True}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    # A raw socket, so the client leaves when the answer is under way (its first token counted), not after a
    # fixed half second that a loaded machine may spend before the first token.
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        ttft_count = idle["base_time_to_first_token_seconds_count"]
        server.wait_until(lambda m: m["base_time_to_first_token_seconds_count"] > ttft_count, "answering")
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing came back yet: 1500 tokens take seconds
            sock.recv(1)
    # The 499 is counted after the request's tokens; idle alone may come first (the engine frees the blocks).
    server.wait_until(lambda m: _count_499(m) > _count_499(idle), "counting the request as 499")
    metrics = server.wait_idle()
    assert metrics["base_num_requests_running"] == 0 and metrics["base_kv_blocks_used"] == 0
    assert 'status="499"' in server.http().get("/metrics").text
    assert 0 < metrics["base_generation_tokens_total"] - before < 1500
