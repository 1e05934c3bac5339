"""`hermes` and `llama3_json` calls (JsonCallParser): any split, text around calls, broken,
repeated and forced calls."""

from __future__ import annotations

import random

import pytest

from baselm.toolcalls.parsers import HERMES, LLAMA3_JSON, JsonCallParser

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>\n'
)


def parse(fmt: str, pieces: list[str], tool_names: tuple[str, ...] = ()) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) calls of an answer fed in `pieces` (the request's tools named)."""
    parser = JsonCallParser(fmt, tool_names=tool_names)
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
    assert parse(HERMES, [HERMES_TEXT]) == expected
    rng = random.Random(0)
    for _ in range(50):
        assert parse(HERMES, _splits(HERMES_TEXT, rng)) == expected


def test_text_after_a_call_stays_content_but_whitespace_between_calls_does_not():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    other = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert parse(HERMES, [call + "\n ", other]) == ("", [("f", "{}"), ("f", '{"a": 1}')])
    assert parse(HERMES, [call, "\n", " Done."]) == ("\n Done.", [("f", "{}")])
    assert parse(HERMES, ["Hi\n", call]) == ("Hi\n", [("f", "{}")])


def test_llama3_json_calls_and_plain_answers():
    text = (
        '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    )
    assert parse(LLAMA3_JSON, [text[:10], text[10:]]) == (
        "",
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Rome"}')],
    )
    assert parse(LLAMA3_JSON, ["  Hello", " world"]) == ("  Hello world", [])
    assert parse(LLAMA3_JSON, ['{"not": "a call"}']) == ('{"not": "a call"}', [])


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
    assert parse(HERMES, [text]) == (text, [])


def test_a_call_that_repeats_an_earlier_one_exactly_is_dropped():
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    other = '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    assert parse(HERMES, [call, "\n", call, "\n", other, call]) == ("", [("f", '{"a": 1}'), ("f", '{"a": 2}')])
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"a": 1}}'
    assert parse(LLAMA3_JSON, [text]) == ("", [("f", '{"a": 1}')])


def test_forced_calls_keep_the_calls_that_closed_and_drop_the_one_cut_short():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    cut = '\n<tool_call>\n{"name": "f", "argu'
    parser = JsonCallParser(HERMES, forced=True)
    content, calls = parser.feed(call + cut)
    more, more_calls = parser.finish()
    assert (content + more, [(c.name, c.arguments) for c in calls + more_calls]) == ("", [("f", "{}")])
    parser = JsonCallParser(LLAMA3_JSON, forced=True)
    parser.feed('{"name": "f", "parameters": {}};{"name": "f", "para')
    content, calls = parser.finish()
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", "{}")])


def _parse_with_tools(pieces: list[str], names: tuple[str, ...] = ("get_weather",)) -> tuple[str, list]:
    return parse(HERMES, pieces, names)


def test_a_hermes_answer_that_is_one_bare_call_of_a_given_tool_is_a_call():
    """Qwen2.5 models often answer `{"name": ..., "arguments": ...}` without the tags; llama.cpp's and
    Ollama's parsers take it as a call. It must name a given tool and parse whole."""
    bare = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    expected = ("", [("get_weather", '{"city": "Paris"}')])
    assert _parse_with_tools([bare]) == expected
    rng = random.Random(0)
    for _ in range(20):
        pieces = _splits(bare, rng)
        parser = JsonCallParser(HERMES, tool_names=("get_weather",))
        assert all(parser.feed(piece) == ("", []) for piece in pieces)  # nothing shown while it may be a call
        assert _parse_with_tools(pieces) == expected
    for text in (
        '{"name": "delete_everything", "arguments": {}}',  # no such tool: the model's words, as they are
        '{"name": "get_weather", "arguments": {"city": "Paris"}} and more',  # not the whole answer
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        '{"city": "Paris"}',  # JSON, but no call
    ):
        assert _parse_with_tools([text]) == (text, []), text
    assert _parse_with_tools(['{"name": "get_weather"}'], names=()) == ('{"name": "get_weather"}', [])  # no tools
    tagged = '{"a": 1} <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert _parse_with_tools([tagged]) == ('{"a": 1} ', [("get_weather", '{"city": "Oslo"}')])
