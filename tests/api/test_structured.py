"""Structured output (response_format) and tool calls, enforced by llguidance on a random tiny model."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest

from baselm.structured.grammar import GrammarProcessor, grammar_tokenizer, json_schema_grammar, lark_grammar
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.tools import HERMES, LLAMA3_JSON, RepeatStop, ToolCallParser, forced_call_lark, tool_format
from tests.api.conftest import MODEL
from tests.paths import BPE_TOKENIZER

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]


def validate(value, schema) -> None:
    """The subset of JSON Schema these tests use; raises AssertionError on a mismatch."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", [])) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            validate(item, schema["items"])


def _chat(server, **kwargs):
    kwargs.setdefault("messages", ASK)
    return server.openai().chat.completions.create(model=MODEL, **kwargs)


def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_output_validates_for_every_seed_and_copy(server):
    response = _chat(server, max_tokens=200, temperature=1.0, seed=5, n=4, response_format=_person_format())
    assert len(response.choices) == 4
    assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode_chat(ASK))  # counted once, not per copy
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        validate(json.loads(choice.message.content), PERSON)
    again = _chat(server, max_tokens=200, temperature=1.0, seed=5, n=4, response_format=_person_format())
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]


def test_json_schema_greedy_and_streamed_agree(server):
    whole = _chat(server, max_tokens=200, temperature=0, response_format=_person_format())
    validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(server, max_tokens=200, temperature=0, response_format=_person_format(), stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content


def test_json_object_parses_even_when_pushed_toward_closing_characters(server):
    tokenizer = server.engine.tokenizer
    bias = {str(tokenizer.token_to_id('"')): 8, str(tokenizer.token_to_id("}")): 8}
    response = _chat(
        server, max_tokens=300, temperature=1.0, seed=11, n=4, logit_bias=bias, response_format={"type": "json_object"}
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_invalid_schema_is_a_400_naming_response_format(server):
    http = server.http()
    body = {
        "model": MODEL,
        "messages": ASK,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}},
        },
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


def test_required_tool_call_follows_the_function_schema(server):
    response = _chat(
        server,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=3,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_calls_that_tool(server):
    response = _chat(
        server,
        max_tokens=120,
        temperature=1.0,
        seed=2,
        n=3,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [c.finish_reason for c in response.choices] == ["tool_calls"] * 3
    for choice in response.choices:
        [call] = choice.message.tool_calls  # one call, though parallel_tool_calls defaults to true
        assert call.function.name == "get_time"
    response = _chat(
        server,
        max_tokens=120,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_tools_whose_parameters_use_defs_can_be_forced(server):
    address = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    parameters = {  # as Pydantic writes a model with a nested model
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"address": {"$ref": "#/$defs/Address"}, "days": {"type": "integer", "maximum": 9}},
        "required": ["address", "days"],
    }
    tool = {"type": "function", "function": {"name": "plan", "parameters": parameters}}
    for choice in ("required", {"type": "function", "function": {"name": "plan"}}):
        response = _chat(server, max_tokens=60, temperature=1.0, seed=1, n=2, tools=[tool, TIME], tool_choice=choice)
        for c in response.choices:
            assert c.finish_reason == "tool_calls", c
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                if call.function.name == "plan":
                    assert arguments["address"]["city"] in ("Paris", "Rome") and arguments["days"] <= 9
                    assert set(arguments) == {"address", "days"}
    as_format = {"type": "json_schema", "json_schema": {"name": "plan", "schema": parameters}}
    answer = json.loads(
        _chat(server, max_tokens=60, temperature=0, response_format=as_format).choices[0].message.content
    )
    assert answer["address"]["city"] in ("Paris", "Rome")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(server):
    kwargs = dict(max_tokens=120, temperature=0, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    whole = _chat(server, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in _chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"
                    call["id"] = delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    [expected] = whole.message.tool_calls
    assert list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (expected.function.name, expected.function.arguments)
    assert calls[0]["id"].startswith("call_")
    assert [r for r in reasons if r] == ["tool_calls"]


def test_auto_renders_tools_into_the_prompt_and_none_leaves_them_out(server):
    with_tools = _chat(server, max_tokens=2, temperature=0, tools=[WEATHER])
    without = _chat(server, max_tokens=2, temperature=0, tools=[WEATHER], tool_choice="none")
    plain = _chat(server, max_tokens=2, temperature=0)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    rendered = server.engine.tokenizer.encode_chat(ASK, tools=[WEATHER])
    assert with_tools.usage.prompt_tokens == len(rendered) > plain.usage.prompt_tokens


def test_forced_tool_call_cut_short_by_max_tokens_is_neither_a_call_nor_content(server):
    for stream in (False, True):
        kwargs = dict(max_tokens=20, temperature=0, tools=[WEATHER], tool_choice="required", stream=stream)
        if stream:
            chunks = [c.choices[0] for c in _chat(server, **kwargs) if c.choices]
            assert "".join(c.delta.content or "" for c in chunks) == ""
            assert not any(c.delta.tool_calls for c in chunks)
            assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
        else:
            choice = _chat(server, **kwargs).choices[0]
            assert choice.finish_reason == "length"
            assert choice.message.tool_calls is None
            assert choice.message.content is None


# ---- the parser on its own ---------------------------------------------------------------------

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>\n'
)


def _run(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser(fmt)
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, calls = content + text, calls + new
    text, new = parser.finish()
    return content + text, [(c.name, c.arguments) for c in calls + new]


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(12, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_hermes_calls_parse_the_same_in_any_split():
    expected = ("Let me check. ", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}')])
    assert _run(HERMES, [HERMES_TEXT]) == expected
    rng = random.Random(0)
    for _ in range(50):
        assert _run(HERMES, _splits(HERMES_TEXT, rng)) == expected


def test_text_after_a_call_stays_content_but_whitespace_between_calls_does_not():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    other = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert _run(HERMES, [call + "\n ", other]) == ("", [("f", "{}"), ("f", '{"a": 1}')])
    assert _run(HERMES, [call, "\n", " Done."]) == ("\n Done.", [("f", "{}")])
    assert _run(HERMES, ["Hi\n", call]) == ("Hi\n", [("f", "{}")])


def test_llama3_json_calls_and_plain_answers():
    text = (
        '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    )
    assert _run(LLAMA3_JSON, [text[:10], text[10:]]) == (
        "",
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Rome"}')],
    )
    assert _run(LLAMA3_JSON, ["  Hello", " world"]) == ("  Hello world", [])
    assert _run(LLAMA3_JSON, ['{"not": "a call"}']) == ('{"not": "a call"}', [])


@pytest.mark.parametrize(
    "text",
    [
        'Sure <tool_call>{"name": "get_time", "arguments": {"zo',  # cut off mid-call
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>not json</tool_call>",
        "a < b <tool_ca",  # a marker that never completes
    ],
)
def test_broken_or_truncated_calls_stay_content(text):
    assert _run(HERMES, [text]) == (text, [])


def test_a_call_that_repeats_an_earlier_one_exactly_is_dropped():
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    other = '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    assert _run(HERMES, [call, "\n", call, "\n", other, call]) == ("", [("f", '{"a": 1}'), ("f", '{"a": 2}')])
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"a": 1}}'
    assert _run(LLAMA3_JSON, [text]) == ("", [("f", '{"a": 1}')])


def test_forced_calls_end_once_a_call_repeats():
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    lark = lark_grammar(forced_call_lark([WEATHER, TIME], HERMES, None, parallel=True))
    call = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>'
    vocab = tokenizer.vocab_size
    for text, only_eos in ((call, False), (call + "\n" + call, True)):
        processor = RepeatStop(lltokenizer, lark, [2], tokenizer, HERMES)
        ids = tokenizer.encode(text, add_special_tokens=False)
        allowed = np.isfinite(np.array(processor(ids, mx.zeros((vocab,)))))
        assert allowed[2]  # the calls may end here
        assert (allowed.sum() == 1) == only_eos  # and after a repeat they must


def test_forced_calls_keep_the_calls_that_closed_and_drop_the_one_cut_short():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    cut = '\n<tool_call>\n{"name": "f", "argu'
    parser = ToolCallParser(HERMES, forced=True)
    content, calls = parser.feed(call + cut)
    more, more_calls = parser.finish()
    assert (content + more, [(c.name, c.arguments) for c in calls + more_calls]) == ("", [("f", "{}")])
    parser = ToolCallParser(LLAMA3_JSON, forced=True)
    parser.feed('{"name": "f", "parameters": {}};{"name": "f", "para')
    content, calls = parser.finish()
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", "{}")])


def test_format_follows_the_chat_template():
    assert tool_format("... <tool_call> ...") == HERMES
    assert tool_format("{{ '<|python_tag|>' }} parameters") == LLAMA3_JSON
    assert tool_format({"default": "x", "tool_use": "ipython ... parameters"}) == LLAMA3_JSON
    assert tool_format(None) == HERMES


# ---- grammars driven by random logits, without a server -----------------------------------------


def _random_walk(processor, vocab: int, seed: int, eos: int, max_steps: int = 400) -> list[int]:
    """Greedy over seeded random logits, masked by `processor`, until eos."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(max_steps):
        logits = processor(out, mx.array(rng.normal(size=vocab).astype(np.float32)))
        token_id = int(mx.argmax(logits).item())
        if token_id == eos:
            return out
        out.append(token_id)
    raise AssertionError("the grammar did not finish")


def test_schema_grammar_works_when_the_model_has_fewer_rows_than_the_tokenizer():
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)  # 702 tokens; this model only emits ids < 256
    lltokenizer = grammar_tokenizer(tokenizer, 256, [2])
    grammar = json_schema_grammar(PERSON)
    for seed in range(5):
        ids = _random_walk(GrammarProcessor(lltokenizer, grammar, [2]), 256, seed, eos=2)
        assert max(ids) < 256
        validate(json.loads(tokenizer.decode(ids)), PERSON)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_call_grammars_parse_back_to_valid_calls(fmt):
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    grammar = lark_grammar(forced_call_lark([WEATHER, TIME], fmt, None, parallel=True))
    for seed in range(4):
        text = tokenizer.decode(
            _random_walk(GrammarProcessor(lltokenizer, grammar, [2]), tokenizer.vocab_size, seed, 2)
        )
        content, calls = _run(fmt, [text])
        assert content == "" and calls, text
        for name, arguments in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[name]
            validate(json.loads(arguments), tool["function"]["parameters"])
