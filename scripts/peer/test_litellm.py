"""litellm against a running `base serve` (BASE_PEER_URL, BASE_PEER_MODEL), through its OpenAI-compatible provider."""

from __future__ import annotations

import asyncio
import json
import os

import litellm

KW = {
    "model": "openai/" + os.environ["BASE_PEER_MODEL"],
    "api_base": os.environ["BASE_PEER_URL"] + "/v1",
    "api_key": "none",
    "temperature": 0,
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_completion_with_usage():
    response = litellm.completion(messages=ASK, max_tokens=16, **KW)
    assert isinstance(response.choices[0].message.content, str) and response.choices[0].message.content
    assert response.usage.completion_tokens > 0 and response.usage.prompt_tokens > 0


def test_stream_reassembles_to_the_whole_answer():
    whole = litellm.completion(messages=ASK, max_tokens=16, **KW).choices[0].message.content
    chunks = list(litellm.completion(messages=ASK, max_tokens=16, stream=True, **KW))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole


def test_async_completion():
    response = asyncio.run(litellm.acompletion(messages=ASK, max_tokens=8, **KW))
    assert response.choices[0].message.content


def test_text_completion():
    response = litellm.text_completion(prompt="Once upon a time", max_tokens=8, **KW)
    assert isinstance(response.choices[0].text, str) and response.choices[0].text


def test_forced_tool_call_parses():
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    response = litellm.completion(
        messages=messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64, **KW
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert response.choices[0].finish_reason == "tool_calls"
    follow_up = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    assert litellm.completion(messages=follow_up, tools=[WEATHER], max_tokens=8, **KW).choices[0].message


def test_json_schema_response_format():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    response = litellm.completion(messages=ASK, response_format=response_format, max_tokens=32, **KW)
    assert isinstance(json.loads(response.choices[0].message.content)["city"], str)
