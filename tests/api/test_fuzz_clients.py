"""Hundreds of malformed requests (deterministic seed) to /v1/responses and /v1/messages (and its
count_tokens): each is a 4xx with that API's own error body, and the server keeps serving."""

from __future__ import annotations

import copy
import json
import random

import pytest

from tests.api.conftest import MODEL
from tests.api.test_errors import assert_serving
from tests.api.test_fuzz import BAD_JSON, WRONG

GOOD_RESPONSE = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
GOOD_MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GOOD_COUNT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
TOO_LONG = "word " * 3000
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}

RESPONSES_BAD = {
    "model": [123, True, [], {}, "", "not-the-model", None],
    "input": [
        None,
        [],
        5,
        {},
        [1],
        [{}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "input_text"}]}],
        [{"role": "user", "content": [5]}],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"type": "function_call"}],
        [{"type": "function_call", "call_id": "c", "name": "f"}],
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
        [{"type": "function_call_output", "call_id": "c"}],
        [{"type": "function_call_output", "call_id": "c", "output": 5}],
        [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}],
        [{"type": "item_reference", "id": "x"}],
        [{"type": "reasoning", "summary": "x"}],
        [{"type": "reasoning", "summary": [{"type": "summary_text"}]}],
        [{"role": "user", "content": TOO_LONG}],
        TOO_LONG,
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
    ],
    "instructions": [5, [], {}, True],
    "max_output_tokens": [0, -1, 1.5, "5", True, 10**12, []],
    "temperature": [-0.1, 2.5, "hot", [], {}, True],
    "top_p": [0, -0.5, 1.01, "1", []],
    "stream": ["yes", 1, 0, [], {}],
    "tools": [
        "x",
        [1],
        [{"type": "web_search"}],
        [{"type": "function"}],
        [{"type": "function", "name": "bad name!"}],
        [{"type": "function", "name": "f", "parameters": "x"}],
        [{"type": "function", "function": {"name": "f"}}],
        [{**FUNCTION, "extra": 1}],
    ],
    "tool_choice": ["always", 5, "required", {"type": "function"}, {"type": "allowed_tools"}, []],
    "parallel_tool_calls": ["yes", 1],
    "text": [
        "json",
        {"format": "x"},
        {"format": {"type": "xml"}},
        {"format": {"type": "json_schema"}},
        {"format": {"type": "json_schema", "name": "x"}},
        {"format": {"type": "json_schema", "name": "x", "schema": "nope"}},
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
        {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}},
        {"format": {"type": "json_object", "extra": 1}},
        {"extra": 1},
    ],
    "previous_response_id": [5, "resp_missing", [], {}],
    "store": ["yes", 1],
    "metadata": ["x", [], {"a": 1}],
    "truncation": ["auto", 5],
    "reasoning": ["high", {"effort": "extreme"}, {"effort": 5}, {"x": 1}],
    "background": [True],
    "conversation": ["conv_1"],
    "top_logprobs": [3],
    "n": [2],
    "seed": [1],
    "stop": ["x"],
    "messages": [[{"role": "user", "content": "x"}]],
    "no_such_field": [1, "x", {}],
}
MESSAGES_BAD = {
    "model": [123, True, [], {}, "", "not-the-model", None],
    "messages": [
        None,
        [],
        "hello",
        {},
        [1],
        [{}],
        [{"role": "user"}],
        [{"role": "system", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        [{"role": "user", "content": [{"type": "document"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [5]}],
        [{"role": "user", "content": [{"type": "tool_result"}]}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
        [{"role": "assistant", "content": [{"type": "tool_use"}]}],
        [{"role": "assistant", "content": [{"type": "thinking"}]}],
        [{"role": "user", "content": "x", "extra": 1}],
    ],
    "system": [5, [5], [{"type": "image"}], [{"type": "text"}], {}, True],
    "tools": [
        "x",
        [1],
        [{"name": "f"}],
        [{"name": "bad name!", "input_schema": {}}],
        [{"type": "computer_20241022", "name": "c"}],
        [{"name": "f", "input_schema": "x"}],
        [{**TOOL, "extra": 1}],
    ],
    "tool_choice": [
        "auto",
        5,
        {"type": "magic"},
        {"type": "tool"},
        {"type": "tool", "name": "missing"},
        {"type": "any"},
    ],
    "thinking": ["on", {"type": "enabled"}, {"type": "sometimes"}, {"type": "enabled", "budget_tokens": 0}, []],
    "no_such_field": [1, "x", {}],
    "n": [2],
}
GENERATING_BAD = {  # fields only /v1/messages reads
    "max_tokens": [None, 0, -1, 1.5, "5", True, 10**12, []],
    "temperature": [-0.1, 1.5, "hot", []],
    "top_p": [0, 1.5, "x"],
    "top_k": [-2, 1.5, "3"],
    "stop_sequences": ["x", [1], [""], {}],
    "stream": ["yes", 1, []],
    "output_config": [
        "x",
        {"format": {"type": "xml"}},
        {"format": {"type": "json_schema", "schema": "x"}},
        {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
        {"effort": 5},
    ],
    "container": ["x"],
    "mcp_servers": [[{}]],
    "messages": [[{"role": "user", "content": TOO_LONG}]],
}
COUNTING_BAD = {"max_tokens": [5], "stream": [True], "temperature": [0.5]}  # count_tokens takes none of these

# Whole conversations with every kind of item or block: the nested mutations start from these.
RICH_RESPONSE = {
    "model": MODEL,
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ],
    "tools": [FUNCTION],
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "max_output_tokens": 2,
}
RICH_MESSAGE = {
    "model": MODEL,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
    ],
    "tools": [TOOL],
    "tool_choice": {"type": "auto"},
    "max_tokens": 2,
}

# Fields that take a string as well as an array of parts.
_TEXT_OR_PARTS = ("input", "content", "system", "output")
# Field values a random pick may land on that are valid after all.
_VALID_BY_CHANCE = {("input", '"text"'), ("instructions", '"text"'), ("system", '"text"'), ("system", "[]")}


def _field_cases(path: str, good: dict, fields: dict) -> list[tuple[str, bytes]]:
    cases = []
    for name, values in fields.items():
        for value in values:
            body = copy.deepcopy(good)
            if value is None:
                body.pop(name, None)  # a required field left out
                if name not in good:
                    continue
            else:
                body[name] = value
            if name in ("tool_choice", "parallel_tool_calls") and value not in ("required", {"type": "any"}):
                body["tools"] = [FUNCTION] if path == "/v1/responses" else [TOOL]
            cases.append((path, json.dumps(body).encode()))
    return cases


def _noise_cases(path: str, good: dict, rng: random.Random) -> list[tuple[str, bytes]]:
    cases = []
    for _ in range(50):  # random wrong types in random fields
        body = copy.deepcopy(good)
        field = rng.choice(sorted(good))
        value = rng.choice(WRONG)
        if value is None or (field, json.dumps(value)) in _VALID_BY_CHANCE:
            value = {"nested": [None]}
        body[field] = value
        cases.append((path, json.dumps(body).encode()))
    cases += [(path, raw) for raw in BAD_JSON]
    raw = json.dumps(good).encode()
    for _ in range(20):  # a good body cut short
        cases.append((path, raw[: rng.randrange(1, len(raw) - 1)]))
    return cases


def _leaves(value, path=()):
    """Paths to every value inside `value` (not `value` itself)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        yield (*path, key)
        yield from _leaves(child, (*path, key))


def _nested_cases(path: str, rich: dict, rng: random.Random) -> list[tuple[str, bytes]]:
    """One value somewhere inside `rich` swapped for one of another JSON type (not null, not empty)."""
    cases = []
    # Not inside a tool's JSON Schema: with tool_choice auto the schema only goes into the prompt.
    leaves = [
        p
        for p in _leaves(rich)
        if p[-1] not in ("model", "max_tokens", "max_output_tokens")
        and not {"parameters", "input_schema"} & set(p[:-1])
    ]
    for _ in range(80):
        where = rng.choice(leaves)
        body = copy.deepcopy(rich)
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        original = parent[where[-1]]
        choices = [w for w in WRONG if w not in (None, [], {}) and type(w) is not type(original)]
        if where[-1] in _TEXT_OR_PARTS:
            choices = [w for w in choices if not isinstance(w, str)]
        parent[where[-1]] = rng.choice(choices)
        cases.append((path, json.dumps(body).encode()))
    return cases


def _cases(path: str) -> list[tuple[str, bytes]]:
    rng = random.Random(20241201)
    if path == "/v1/responses":
        good, fields, rich = GOOD_RESPONSE, RESPONSES_BAD, RICH_RESPONSE
    elif path == "/v1/messages":
        good, fields, rich = GOOD_MESSAGE, {**MESSAGES_BAD, **GENERATING_BAD}, RICH_MESSAGE
    else:
        good, fields = GOOD_COUNT, {**MESSAGES_BAD, **COUNTING_BAD}
        rich = {k: v for k, v in RICH_MESSAGE.items() if k != "max_tokens"}
    return _field_cases(path, good, fields) + _noise_cases(path, good, rng) + _nested_cases(path, rich, rng)


def _assert_openai_error(response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]


def _assert_anthropic_error(response) -> None:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
def test_malformed_requests_get_4xx_in_the_apis_own_shape(server, path):
    cases = _cases(path)
    assert len(cases) >= 200
    check = _assert_openai_error if path == "/v1/responses" else _assert_anthropic_error
    http = server.http()
    for _, raw in cases:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (path, raw[:200], response.status_code, response.text[:300])
        check(response)
    assert_serving(server)
