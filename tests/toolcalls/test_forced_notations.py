"""Forced calls in the formats whose arguments are not JSON: Gemma 4's notation, LFM2's Python calls
(notations.py), and Hunyuan 3's `:opensource` XML. Seeded random walks through the server's own
processor parse back to valid, distinct calls with no content; hand-written calls show what the
grammar takes and what the reader makes of it; schemas a notation cannot hold are refused by name."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from baselm.structured.grammar import lark_grammar
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.forced_formats import WRITERS
from baselm.toolcalls.forcing import forced_call_lark
from baselm.toolcalls.markers import MARKERS
from baselm.toolcalls.parsers import READERS, make_parser
from tests.api.test_tool_formats_served import tokenizer_with_special
from tests.paths import BPE_TOKENIZER
from tests.structured.schemas import WEATHER, validate
from tests.structured.test_json_schemas import LLTOKENIZER, accepts
from tests.toolcalls.test_forcing import walk_forced

NOTATIONS = ["gemma4", "lfm2", "hunyuan_3"]
STOP = {
    "type": "object",
    "properties": {
        "name": {"enum": ["O'Hare", 'Le "Dôme"', "a\\b"]},
        "hours": {"type": "integer", "minimum": 0, "maximum": 48},
    },
    "required": ["name"],
}
TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "budget": {"type": "number", "minimum": 0, "maximum": 500},
                "refundable": {"type": "boolean"},
                "note": {"type": ["string", "null"], "maxLength": 5},
                "stops": {"type": "array", "items": STOP, "maxItems": 2},
                "2nd-city": {"type": "string", "maxLength": 4},  # Gemma 4 writes it as a string; Python cannot
            },
            "required": ["city", "nights", "refundable"],
        },
    },
}
TOOLS = {"plan_trip": TRIP, "get_weather": WEATHER}


def _calls(fmt: str, text: str) -> list[tuple[str, dict]]:
    """The calls the format's reader finds in a whole answer, which must hold nothing else."""
    parser = make_parser(fmt, True, list(TOOLS.values()))
    content, calls = parser.feed(text)
    more, more_calls = parser.finish()
    assert content + more == "", text
    return [(c.name, json.loads(c.arguments)) for c in calls + more_calls]


@pytest.mark.parametrize("fmt", NOTATIONS)
@pytest.mark.parametrize("special", [False, True], ids=["markers-as-text", "markers-as-tokens"])
def test_forced_calls_with_rich_arguments_parse_back_to_valid_distinct_calls(fmt, special):
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    if special:
        tokenizer = tokenizer_with_special(*MARKERS[fmt])
    kinds = set()
    for seed in range(6):
        text = walk_forced(fmt, "", tokenizer, seed, tools=(TRIP, WEATHER))
        calls = _calls(fmt, text)
        assert calls, text
        for name, arguments in calls:
            validate(arguments, TOOLS[name]["function"]["parameters"])
            kinds |= {(name, key, type(value).__name__) for key, value in arguments.items()}
        named = [json.dumps(call, sort_keys=True) for call in calls]
        assert len(set(named)) == len(named), text  # a repeat ends the answer and is dropped
    assert ("plan_trip", "refundable", "bool") in kinds and ("get_weather", "days", "int") in kinds


def test_gemma4_quote_held_as_a_special_token_is_asked_for_as_that_token():
    tokenizer = tokenizer_with_special(*MARKERS["gemma4"])
    quote = tokenizer.token_to_id('<|"|>')
    text = walk_forced("gemma4", "", tokenizer, seed=1, tools=(TRIP,))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.token_to_id("<|tool_call>")
    assert ids.count(quote) == text.count('<|"|>') > 0  # every quote is the token, none spelled out
    assert _calls("gemma4", text)


def _grammar(fmt: str, tools: list, marker_ids: dict | None = None) -> str:
    return lark_grammar(forced_call_lark(tools, fmt, None, True, marker_ids or {}))


GEMMA_CALL = (
    '<|tool_call>call:plan_trip{<|"|>2nd-city<|"|>:<|"|>Oslo<|"|>,city:<|"|>It\'s "x"<|"|>,nights:2,note:None,'
    'refundable:false,stops:[{hours:3,name:<|"|>O\'Hare<|"|>},{name:<|"|>a\\b<|"|>}]}<tool_call|>'
)
PYTHON_CALL = (
    "<|tool_call_start|>[plan_trip(city='It\\'s \"x\"', nights=2, refundable=False, note=None, "
    "stops=[{'name': 'O\\'Hare', 'hours': 3}, {'name': 'a\\\\b'}])]<|tool_call_end|>"
)
ARGUMENTS = {
    "city": 'It\'s "x"',
    "nights": 2,
    "refundable": False,
    "note": None,
    "stops": [{"name": "O'Hare", "hours": 3}, {"name": "a\\b"}],
}


@pytest.mark.parametrize(
    ("fmt", "text", "extra"), [("gemma4", GEMMA_CALL, {"2nd-city": "Oslo"}), ("lfm2", PYTHON_CALL, {})]
)
def test_a_call_written_as_the_template_writes_it_is_taken_and_read_back_exactly(fmt, text, extra):
    assert accepts(_grammar(fmt, [TRIP]), text)
    assert _calls(fmt, text) == [("plan_trip", ARGUMENTS | extra)]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("gemma4", GEMMA_CALL.replace("nights:2,", "")),  # a required key left out
        ("gemma4", GEMMA_CALL.replace("nights:2,note:None,", "note:None,nights:2,")),  # keys out of order
        ("gemma4", GEMMA_CALL.replace("Oslo", 'Os<|"|>lo')),  # a quote inside a string
        ("gemma4", GEMMA_CALL.replace("Oslo", "Oslo!")),  # longer than maxLength
        ("gemma4", GEMMA_CALL.replace("hours:3", "hours:49")),  # above its maximum
        ("gemma4", GEMMA_CALL.replace("refundable:false", "refundable:False")),  # Python's, not Gemma's
        ("lfm2", PYTHON_CALL.replace("False", "false")),
        ("lfm2", PYTHON_CALL.replace("'It\\'s", "\"It\\'s")),  # the template's quotes only
        ("lfm2", PYTHON_CALL.replace("nights=2", "nights=2.5")),
        ("lfm2", PYTHON_CALL.replace("city='It", "city='<|tool_call_end|>It")),  # the block's close in a string
    ],
)
def test_the_grammar_refuses_what_the_reader_would_not_read_as_valid_arguments(fmt, text):
    assert not accepts(_grammar(fmt, [TRIP]), text)


TREE = {
    "type": "function",
    "function": {
        "name": "grow",
        "parameters": {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                }
            },
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}, "tags": {"type": "object"}},
            "required": ["root"],
        },
    },
}


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("gemma4", "<|tool_call>call:grow{root:{kids:[{v:1},{kids:[{v:3}],v:2}],v:0},tags:{a:1,b:[true]}}<tool_call|>"),
        (
            "lfm2",
            "<|tool_call_start|>[grow(root={'v': 0, 'kids': [{'v': 1}, {'v': 2, 'kids': [{'v': 3}]}]}, "
            "tags={'a': 1, 'b': [True]})]<|tool_call_end|>",
        ),
    ],
)
def test_recursive_refs_and_free_maps_are_written_in_the_notation(fmt, text):
    assert accepts(_grammar(fmt, [TREE]), text)
    root = {"v": 0, "kids": [{"v": 1}, {"v": 2, "kids": [{"v": 3}]}]}
    assert _calls(fmt, text) == [("grow", {"root": root, "tags": {"a": 1, "b": [True]}})]


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize(
    ("fmt", "tool", "message"),
    [
        ("gemma4", _tool("f", {"properties": {"a": {"type": "array", "uniqueItems": True}}}), "a uses 'uniqueItems'"),
        ("lfm2", _tool("f", {"properties": {"a": {"not": {"type": "string"}}}}), "a uses 'not'"),
        ("lfm2", _tool("f", {"properties": {"class": {"type": "string"}}, "required": ["class"]}), "class is a key"),
        ("lfm2", _tool("get-weather", {}), "Python cannot name it"),
        ("gemma4", _tool("f{", {}), "its name holds"),
        ("gemma4", _tool("f", {"properties": {"a": {"allOf": [{}, {}]}}}), "more than one schema"),
        ("lfm2", _tool("f", {"properties": {"a": {}}, "minProperties": 1}), "parameters uses 'minProperties'"),
    ],
)
def test_schemas_a_notation_cannot_hold_are_refused_by_name(fmt, tool, message):
    with pytest.raises(ToolCallError, match=message) as caught:
        forced_call_lark([tool], fmt, None, False)
    assert caught.value.param == "tools" and fmt in str(caught.value)


def test_an_optional_key_python_cannot_name_is_left_out():
    tool = _tool("f", {"properties": {"class": {"type": "string"}, "a": {"type": "integer", "maximum": 3}}})
    grammar = _grammar("lfm2", [tool])
    assert accepts(grammar, "<|tool_call_start|>[f(a=2)]<|tool_call_end|>")
    assert accepts(grammar, "<|tool_call_start|>[f()]<|tool_call_end|>")
    assert not accepts(grammar, "<|tool_call_start|>[f(class='x')]<|tool_call_end|>")


@pytest.mark.parametrize("fmt", NOTATIONS)
def test_the_grammars_compile_for_llguidance(fmt):
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(_grammar(fmt, [TRIP, TREE]), LLTOKENIZER)
    assert not is_error, messages


def test_every_format_the_parser_reads_can_be_forced():
    """forced_call_lark writes hermes' and llama3_json's grammars itself and forced_formats.py every other's."""
    assert set(READERS) - set(WRITERS) == set()
