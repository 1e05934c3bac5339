"""litellm's OpenAI-compatible provider (`openai/NAME` with `api_base`) against SmolLM2-135M served on loopback,
or the server tests/tools/peer_suites.py names: chat, streaming, async, text completion, a forced tool call
(whole, streamed) and its follow-up, embeddings, a JSON Schema answer."""

from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no fetch at import
import litellm  # noqa: E402

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def kw(client_target) -> dict:
    return {
        "model": "openai/" + client_target.model,
        "api_base": client_target.url + "/v1",
        "api_key": "none",
        "temperature": 0,
        "max_tokens": 16,
    }


def test_completion_answers_with_usage(kw):
    response = litellm.completion(messages=ASK, **kw)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and 0 < response.usage.completion_tokens <= 16


def test_stream_reassembles_to_the_whole_answer(kw):
    whole = litellm.completion(messages=ASK, **kw).choices[0].message.content
    chunks = list(litellm.completion(messages=ASK, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_async_completion_and_stream_answer_alike(kw):
    whole = (await litellm.acompletion(messages=ASK, **kw)).choices[0].message.content
    stream = await litellm.acompletion(messages=ASK, stream=True, **kw)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == whole
    assert "Paris" in whole


def test_text_completion(kw):
    response = litellm.text_completion(prompt="Once upon a time", **kw)
    assert response.choices[0].text.strip() and response.usage.completion_tokens > 0


def test_forced_tool_call_and_its_follow_up(kw):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    response = litellm.completion(
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        **{**kw, "max_tokens": 64},
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert call.id and response.choices[0].finish_reason == "tool_calls"
    follow_up = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = litellm.completion(messages=follow_up, tools=[WEATHER], **kw).choices[0].message
    assert answer.content and not answer.tool_calls


def test_streamed_forced_tool_call_rebuilds_to_the_call(kw):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    args = {"messages": messages, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    whole = litellm.completion(**args, **{**kw, "max_tokens": 64}).choices[0].message.tool_calls
    chunks = list(litellm.completion(**args, stream=True, **{**kw, "max_tokens": 64}))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages).choices[0]
    [call] = rebuilt.message.tool_calls
    assert rebuilt.finish_reason == "tool_calls" and call.id
    assert (call.function.name, call.function.arguments) == (whole[0].function.name, whole[0].function.arguments)


def test_embedding(kw):
    response = litellm.embedding(model=kw["model"], api_base=kw["api_base"], api_key="none", input=["a", "b"])
    first, second = (item["embedding"] for item in response.data)
    assert len(first) == len(second) > 0 and first != second
    assert math.isclose(math.fsum(x * x for x in first), 1.0, rel_tol=1e-4)  # OpenAI's vectors have length 1
    assert response.usage.prompt_tokens > 0


def test_json_schema_response_format(kw):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    response = litellm.completion(messages=ASK, response_format=response_format, **{**kw, "max_tokens": 32})
    assert json.loads(response.choices[0].message.content) == {"city": "Paris"}
