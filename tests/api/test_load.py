"""Many streams at once, and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

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
    long = dict(model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True}, stream=True)
    leaver = client.chat.completions.create(messages=_prompt(1), **long)
    stayer = client.chat.completions.create(messages=_prompt(2), **long)
    leaver_chunks = iter(leaver)
    for _ in range(5):
        next(leaver_chunks)
    stayer_chunks = iter(stayer)
    next(stayer_chunks)
    leaver.close()

    deadline = time.monotonic() + 20
    while server.metrics()["base_num_requests_running"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    during = server.metrics()
    assert during["base_num_requests_running"] == 1
    # Only the staying stream holds blocks: its prompt and at most 400 new tokens, 16 per block.
    stayer_prompt = len(server.engine.tokenizer.encode_chat(_prompt(2)))
    assert 0 < during["base_kv_blocks_used"] <= -(-(stayer_prompt + 400) // 16)

    text, reason = "", ""
    for chunk in stayer_chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert reason == "length" and text
    after = server.wait_idle()
    assert after["base_kv_blocks_used"] == 0 and after["base_num_requests_running"] == 0


def test_a_client_that_leaves_before_a_whole_answer_aborts_it(server):
    before = server.wait_idle()["base_generation_tokens_total"]
    body = {"model": MODEL, "messages": _prompt(3), "max_tokens": 1500, "ignore_eos": True}
    with server.http() as http:
        try:
            http.post("/v1/chat/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("1500 tokens came back within half a second")
    metrics = server.wait_idle(timeout=10)
    assert metrics["base_num_requests_running"] == 0 and metrics["base_kv_blocks_used"] == 0
    assert 'status="499"' in server.http().get("/metrics").text
    assert 0 < metrics["base_generation_tokens_total"] - before < 1500
