"""Tool-call formats beyond Hermes (make_parser, RereadingParser): parsing whole and streamed, cut-off calls."""

from __future__ import annotations

import json
import random

import pytest

from baselm.toolcalls.markers import DEEPSEEK, GLM, HARMONY, MARKERS, MISTRAL, QWEN3_XML
from baselm.toolcalls.parsers import LLAMA3_JSON, MARKER_STARTS, READERS, make_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
            },
        },
    }
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET"})

# Each format: an answer with content before two calls, and what it holds.
ANSWERS = {
    MISTRAL: (
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Checking.",
        [WEATHER, TIME],
    ),
    "mistral_v11": (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}',
        "Checking.",
        [WEATHER, TIME],
    ),
    HARMONY: (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "days": 3}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary'
        ' json<|message|>{"zone": "CET"}',
        "Checking.",
        [WEATHER, TIME],
    ),
    DEEPSEEK: (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
        '{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
        [WEATHER, TIME],
    ),
    QWEN3_XML: (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
        "</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        [WEATHER, TIME],
    ),
    GLM: (
        "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days"
        "</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>zone</arg_key>\n"
        "<arg_value>CET</arg_value>\n</tool_call>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "kimi_k2": (
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        '<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>',
        "Checking.",
        [WEATHER, TIME],
    ),
    "minimax_m2": (
        'Checking.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="zone">CET'
        "</parameter>\n</invoke>\n</minimax:tool_call>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "seed_oss": (
        "Checking.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>3"
        "</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n<parameter=zone>CET"
        "</parameter>\n</function>\n</seed:tool_call>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "functionary_v3_1": (
        'Checking.<function=get_weather>{"city": "Paris", "days": 3}</function><function=get_time>{"zone": "CET"}'
        "</function>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "tool_calls_json": (
        'Checking.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</tool_calls>'
        '<tool_calls>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_calls>',
        "Checking.",
        [WEATHER, TIME],
    ),
    "nemotron_json": (
        'Checking.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]</TOOLCALL>',
        "Checking.",
        [WEATHER, TIME],
    ),
    "cohere": (
        'Checking.<|START_ACTION|>[\n {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": '
        '"Paris", "days": 3}},\n {"tool_call_id": "1", "tool_name": "get_time", "parameters": {"zone": "CET"}}\n]'
        "<|END_ACTION|>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "lfm2": (
        "Checking.<|tool_call_start|>[get_weather(city='Paris', days=3), get_time(zone='CET')]<|tool_call_end|>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "gemma4": (
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_call>call:get_time'
        '{zone:<|"|>CET<|"|>}<tool_call|>',
        "Checking.",
        [WEATHER, TIME],
    ),
    "deepseek_v4": (
        'Checking.<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">CET</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "minicpm5": (
        'Checking.<function name="get_weather"><param name="city"><![CDATA[Paris]]></param><param name="days">3'
        '</param></function>\n<function name="get_time"><param name="zone">CET</param></function>',
        "Checking.",
        [WEATHER, TIME],
    ),
    "hunyuan_3": (
        "Checking.<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
        "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n"
        "<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
        "</tool_call:opensource>\n<tool_call:opensource>get_time<tool_sep:opensource>\n<arg_key:opensource>zone"
        "</arg_key:opensource>\n<arg_value:opensource>CET</arg_value:opensource>\n</tool_call:opensource>\n"
        "</tool_calls:opensource>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "apertus": (
        'Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, {"get_time": {"zone": "CET"}}]'
        "<|tools_suffix|>",
        "Checking.",
        [WEATHER, TIME],
    ),
    "granite_3": (
        'Checking.<|tool_call|>[{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}, '
        '{"arguments": {"zone": "CET"}, "name": "get_time"}]',
        "Checking.",
        [WEATHER, TIME],
    ),
    LLAMA3_JSON: (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [WEATHER, TIME],
    ),
}


def fmt_of(name: str) -> str:
    return MISTRAL if name == "mistral_v11" else name


def run(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Content and calls of an answer fed in `pieces`, as a client would reassemble them."""
    parser = make_parser(fmt, tools=TOOLS)
    content, calls = "", []
    for piece in [*pieces, None]:
        text, new = parser.feed(piece) if piece is not None else parser.finish()
        content += text
        calls += new
    assert [c.index for c in calls] == list(range(len(calls)))
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(15, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(ANSWERS))
def test_whole_answer_gives_content_and_calls(name):
    text, content, calls = ANSWERS[name]
    assert run(fmt_of(name), [text]) == (content, calls)


@pytest.mark.parametrize("name", list(ANSWERS))
def test_streamed_answer_reassembles_to_the_whole_result(name):
    text, content, calls = ANSWERS[name]
    rng = random.Random(7)
    for _ in range(40):
        assert run(fmt_of(name), splits(text, rng)) == (content, calls)
    assert run(fmt_of(name), list(text)) == (content, calls)  # one character at a time


@pytest.mark.parametrize("name", list(ANSWERS))
def test_cut_off_answer_never_returns_a_partial_call(name):
    # Whatever the point the answer stops at, the calls returned are complete calls of the answer.
    text, _, calls = ANSWERS[name]
    for end in range(len(text)):
        _, got = run(fmt_of(name), [text[:end]])
        assert got == calls[: len(got)], text[:end]


@pytest.mark.parametrize("name", [n for n in ANSWERS if n not in (HARMONY, LLAMA3_JSON)])
def test_a_call_cut_off_mid_arguments_is_returned_as_content(name):
    text, content, _ = ANSWERS[name]
    cut = text[: text.index("Paris") + 3]
    assert run(fmt_of(name), [cut]) == (cut, [])


def test_harmony_leaves_the_analysis_channel_out_and_streams_the_final_one():
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi there"
    assert run(HARMONY, [text]) == ("Hi there", [])
    parser = make_parser(HARMONY)
    assert parser.feed(text[:-4]) == ("Hi t", [])  # final-channel text streams before its message ends
    assert parser.feed("here<|") == ("here", [])  # a marker's start is held back
    assert parser.finish() == ("<|", [])


def test_answers_without_calls_are_plain_content():
    for fmt in READERS:
        assert run(fmt, ["Just ", "text [x] <y> ", "end."]) == ("Just text [x] <y> end.", []), fmt


def test_broken_calls_stay_content():
    broken = {
        MISTRAL: '[TOOL_CALLS][{"name": "f", "arguments": [1]}]',
        DEEPSEEK: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜>",
        QWEN3_XML: "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",
        GLM: "<tool_call>\n<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>",
        "lfm2": "<|tool_call_start|>[__import__('os').system('x')]<|tool_call_end|>",  # read, never run
        "tool_calls_json": '<tool_calls>[{"name": "f"}, 3]</tool_calls>',
    }
    for fmt, text in broken.items():
        assert run(fmt, [text]) == (text, []), fmt


def test_xml_parameters_are_read_as_the_tool_schema_types_them():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    )
    # city is a string in the schema even when it looks like a number; an unknown one is read as JSON
    assert run(QWEN3_XML, [text]) == ("", [("get_weather", {"city": "123", "days": 3, "extra": [1, 2]})])


def test_llama3_python_tag_is_no_content():
    assert run(LLAMA3_JSON, ["<|python", '_tag|>{"name": "f", "parameters": {}}']) == ("", [("f", {})])
    assert run(LLAMA3_JSON, ["Hello <|pyth", "on"]) == ("Hello <|python", [])


def test_gemma4_notation_reads_nested_values_lists_and_none():
    text = '<|tool_call>call:f{a:[1,<|"|>x, y:z<|"|>],b:{<|"|>k<|"|>:None},c:false,d:-2.5}<tool_call|>'
    assert run("gemma4", [text]) == ("", [("f", {"a": [1, "x, y:z"], "b": {"k": None}, "c": False, "d": -2.5})])


def test_every_marker_starts_with_a_character_plain_text_is_checked_for():
    # Plain text without these characters streams without being read again (RereadingParser).
    assert {m[0] for fmt in READERS for m in MARKERS[fmt]} <= MARKER_STARTS


def test_plain_text_before_a_call_streams_as_it_comes():
    parser = make_parser(MISTRAL)
    assert parser.feed("Sure, ") == ("Sure, ", [])
    assert parser.feed("one moment.") == ("one moment.", [])
    assert parser.feed("[TOOL_") == ("", [])
    assert parser.feed('CALLS][{"name": "f", "arguments": {}}]')[1][0].name == "f"
    assert parser.finish() == ("", [])
