"""Hundreds of malformed requests (deterministic seed): each is a 4xx with the OpenAI error body,
and the server answers a good request afterwards."""

from __future__ import annotations

import copy
import json
import random

from tests.api.conftest import MODEL
from tests.api.test_errors import assert_serving

GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GOOD_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
WRONG = [None, True, "text", -1, 10**30, 1.5e308, [], {}, [1, "a"], {"a": {"b": []}}, float("nan")]

# Values each field must refuse (None is dropped: null means "not given" for optional fields).
BAD_VALUES = {
    "model": [123, True, [], {}, "", "not-the-model", None],
    "max_tokens": [0, -1, 1.5, "5", True, 10**12, []],
    "max_completion_tokens": [0, -5, "x", 2.5],
    "temperature": [-0.1, 2.5, "hot", [], {}, 1e300, True],
    "top_p": [0, -0.5, 1.01, "1", []],
    "n": [0, -3, 17, 1.5, "2", True],
    "stream": ["yes", 1, 0, [], {}],
    "stop": [5, [1, 2], [""], "", [None], ["a"] * 17, {}],
    "seed": ["42", 1.5, 2**70, [], True],
    "presence_penalty": [-2.5, 3, "x", []],
    "frequency_penalty": [2.01, -9, {}, "0"],
    "logit_bias": [[], "x", {"abc": 1}, {"1": 101}, {"1": "x"}, {"-1": 0}, {"99999999": 5}, {"1": True}],
    "top_k": [-2, 1.5, "3"],
    "min_p": [-0.1, 1.1, "x"],
    "repetition_penalty": [0, -1, "x"],
    "min_tokens": [-1, "x", 3],
    "ignore_eos": ["true", 1],
    "stream_options": [{"include_usage": True}, "x", []],
    "no_such_field": [1, "x", None, {}],
}
CHAT_BAD = {
    "messages": [
        None,
        [],
        "hello",
        {},
        [1],
        [{}],
        [{"role": "user"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [5]}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"role": "assistant", "tool_calls": [{"id": "1"}]}],
        [{"role": "user", "content": "x" * 20000}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
    ],
    "logprobs": ["yes", 1],
    "top_logprobs": [-1, 21, "3", 5],
    "response_format": [
        "json",
        {},
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        {"type": "json_object", "extra": 1},
    ],
    "tools": [
        "x",
        [1],
        [{"type": "retrieval"}],
        [{"type": "function"}],
        [{"type": "function", "function": {}}],
        [{"type": "function", "function": {"name": "bad name!"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    ],
    "tool_choice": ["always", 5, {"type": "function"}, {"type": "function", "function": {"name": "missing"}}],
    "echo": [True],
    "min_tokens": [-1, "x", 3, 1],  # 1: with a grammar (see _cases)
}
COMPLETION_BAD = {
    "prompt": [None, [], 5, [[]], [-1], [1.5], ["a", 1], [[1], "a"], [True], [10**9], "", "word " * 3000, {}],
    "logprobs": [-1, 21, "2", True],
    "echo": ["yes"],
    "suffix": ["x"],
    "best_of": [3, 0, "x"],
    "messages": [[{"role": "user", "content": "x"}]],
}
BAD_JSON = [
    b"",
    b"   ",
    b"{",
    b"}",
    b"[]",
    b"null",
    b"42",
    b'"text"',
    b"{'model': 'tiny'}",
    b'{"model": tiny}',
    b"\x00\x01\x02",
    b"\xff\xfe\xfd",
    b'{"model": "tiny",}',
    b"[" * 5000 + b"]" * 5000,
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]',
    b"NaN",
]

_VALID_BY_CHANCE = {("stop", '"text"'), ("stop", "[]"), ("prompt", '"text"')}


def _cases(rng: random.Random) -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    for path, good, fields in (
        ("/v1/chat/completions", GOOD_CHAT, {**BAD_VALUES, **CHAT_BAD}),
        ("/v1/completions", GOOD_COMPLETION, {**BAD_VALUES, **COMPLETION_BAD}),
    ):
        for name, values in fields.items():
            for value in values:
                if value is None and name not in ("model", "messages", "prompt", "no_such_field"):
                    continue
                body = copy.deepcopy(good)
                if name == "min_tokens":
                    body["max_tokens"] = 2  # min_tokens 3 > max_tokens 2
                    if value == 1:
                        body["response_format"] = {"type": "json_object"}
                if name == "top_logprobs" and value == 5:
                    pass  # top_logprobs without logprobs
                if name == "stream_options" and isinstance(value, dict):
                    pass  # stream_options without stream
                body[name] = value
                if value is None and name == "no_such_field":
                    body[name] = 0
                cases.append((path, json.dumps(body).encode()))
        for _ in range(40):  # random wrong types in random fields
            body = copy.deepcopy(good)
            field = rng.choice(sorted(k for k in body if k != "max_tokens") + ["n", "temperature", "stop"])
            value = rng.choice(WRONG)
            if value is None or (field, json.dumps(value)) in _VALID_BY_CHANCE:
                value = {"nested": [None]}
            body[field] = value
            cases.append((path, json.dumps(body).encode()))
        for raw in BAD_JSON:
            cases.append((path, raw))
        for _ in range(15):  # a good body cut short or with a byte flipped into garbage
            raw = bytearray(json.dumps(good).encode())
            cut = rng.randrange(1, len(raw) - 1)
            cases.append((path, bytes(raw[:cut])))
    return cases


def test_malformed_requests_get_4xx_openai_errors(server):
    cases = _cases(random.Random(20241129))
    assert len(cases) >= 300
    http = server.http()
    for path, raw in cases:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (path, raw[:200], response.status_code, response.text[:300])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, raw[:200]
        assert "Traceback" not in error["message"]
    assert_serving(server)
