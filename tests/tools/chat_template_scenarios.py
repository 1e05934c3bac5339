"""The conversations every real chat template is rendered with (tests/tools/make_chat_template_fixtures.py).

OpenAI/HF shaped messages: system, user and assistant turns, tool definitions, assistant tool
calls (arguments as a dict, as HF templates take them), tool results, with and without the
generation prompt, and an assistant turn with its reasoning.
"""

from __future__ import annotations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "IANA zone, e.g. Europe/Paris"}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}
WEATHER_QUESTION = {"role": "user", "content": "What's the weather in Paris, and the time there?"}


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Content "" as many clients send it (None would be dropped: many templates then fail on it). Ids
# of nine letters and digits, the only ones Mistral's templates accept.
ONE_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [_call("call00001", "get_weather", {"city": "Paris", "unit": "celsius"})],
}
TWO_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        _call("call00001", "get_weather", {"city": "Paris", "unit": "celsius"}),
        _call("call00002", "get_time", {"zone": "Europe/Paris"}),
    ],
}
WEATHER_RESULT = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temp": 21}'}
TIME_RESULT = {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": "14:05"}

SCENARIOS = {
    "chat": {"messages": [SYSTEM, USER, ASSISTANT, FOLLOW_UP], "add_generation_prompt": True},
    "no_system": {"messages": [USER, ASSISTANT, FOLLOW_UP], "add_generation_prompt": True},
    "no_generation_prompt": {"messages": [SYSTEM, USER, ASSISTANT], "add_generation_prompt": False},
    "tools": {"messages": [SYSTEM, WEATHER_QUESTION], "tools": TOOLS, "add_generation_prompt": True},
    "tool_call": {
        "messages": [WEATHER_QUESTION, ONE_CALL, WEATHER_RESULT],
        "tools": TOOLS,
        "add_generation_prompt": True,
    },
    "parallel_tool_calls": {
        "messages": [
            SYSTEM,
            WEATHER_QUESTION,
            TWO_CALLS,
            WEATHER_RESULT,
            TIME_RESULT,
            {"role": "assistant", "content": "It is 21 °C and 14:05 in Paris."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": TOOLS,
        "add_generation_prompt": True,
    },
    "reasoning": {
        "messages": [
            USER,
            {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
            FOLLOW_UP,
        ],
        "add_generation_prompt": True,
    },
}
# strftime_now() is pinned to this moment on both sides, so templates that print today's date agree.
NOW = "2026-01-15T12:00:00"
