"""Schemas made to end: closed objects, bounded numbers, compact JSON, nested $defs hoisted."""

from __future__ import annotations

import json

import llguidance as llg

from baselm.structured.grammar import grammar_tokenizer, json_schema_grammar
from baselm.structured.json_schemas import MAX_INTEGER, nest, prepare
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER

TOKENIZER = Tokenizer.from_folder(BPE_TOKENIZER)
LLTOKENIZER = grammar_tokenizer(TOKENIZER, TOKENIZER.vocab_size, [2])


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (fed as the tokenizer splits it)."""
    matcher = llg.LLMatcher(LLTOKENIZER, grammar, log_level=0)
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def test_prepare_closes_objects_that_list_properties_but_not_maps_or_allof_parts():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}},
        "$defs": {"M": {"type": "object", "additionalProperties": {"type": "string"}}},
        "allOf": [{"properties": {"c": {"type": "string"}}}],
    }
    prepared = prepare(schema)
    assert "additionalProperties" not in prepared  # it has allOf: its parts name the other properties
    assert prepared["properties"]["a"]["additionalProperties"] is False
    assert prepared["$defs"]["M"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in prepared["allOf"][0]
    assert "additionalProperties" not in schema["properties"]["a"]  # the caller's schema is untouched


def test_prepare_bounds_open_numbers_and_keeps_the_schemas_own_bounds():
    prepared = prepare(
        {
            "type": "object",
            "properties": {
                "i": {"type": "integer"},
                "n": {"type": ["number", "null"]},
                "own": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10**20},
                "step": {"type": "number", "multipleOf": 0.5},
                "items": {"type": "array", "items": {"type": "integer"}},
            },
        }
    )
    props = prepared["properties"]
    assert (props["i"]["minimum"], props["i"]["maximum"]) == (-MAX_INTEGER, MAX_INTEGER)
    assert props["n"]["multipleOf"] == 1e-10 and props["n"]["maximum"] == MAX_INTEGER
    assert props["own"] == {"type": "integer", "minimum": 0, "exclusiveMaximum": 10**20}
    assert props["step"]["multipleOf"] == 0.5
    assert props["items"]["items"]["maximum"] == MAX_INTEGER


def test_json_is_compact_unless_the_schema_asks_for_flexible_whitespace():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    compact = json_schema_grammar(schema)
    assert accepts(compact, '{"a":1,"b":[2,3]}')
    assert not accepts(compact, '{"a": 1,"b":[2,3]}')
    assert not accepts(compact, '{"a":1 ,"b":[2,3]}')
    flexible = json_schema_grammar({**schema, "x-guidance": {"whitespace_flexible": True}})
    assert accepts(flexible, '{ "a" : 1,\n "b": [2, 3] }')


def test_numbers_have_at_most_16_digits_before_the_point_and_10_after():
    grammar = json_schema_grammar({"type": "object", "properties": {"i": {"type": "integer"}, "x": {"type": "number"}}})
    assert accepts(grammar, '{"i":-9999999999999999,"x":1.0123456789}')
    assert not accepts(grammar, '{"i":12345678901234567,"x":1}')
    assert not accepts(grammar, '{"i":1,"x":1.01234567891}')
    assert not accepts(grammar, '{"i":1,"x":1e5}')
    assert not accepts(grammar, '{"i":1,"x":1,"extra":2}')


def test_nest_hoists_defs_and_points_local_refs_at_the_new_place():
    schema = {
        "type": "object",
        "properties": {"d": {"$ref": "#/$defs/D"}, "self": {"$ref": "#"}, "e": {"$ref": "#/definitions/E"}},
        "$defs": {"D": {"type": "array", "items": {"$ref": "#/$defs/D"}}},
        "definitions": {"E": {"enum": [{"$ref": "#/not/a/ref"}]}},
    }
    nested, defs = nest(schema, "/anyOf/0/properties/arguments", "0.")
    assert nested["properties"] == {
        "d": {"$ref": "#/$defs/0.D"},
        "self": {"$ref": "#/anyOf/0/properties/arguments"},
        "e": {"$ref": "#/$defs/0.E"},
    }
    assert "$defs" not in nested and "definitions" not in nested
    assert defs == {
        "0.D": {"type": "array", "items": {"$ref": "#/$defs/0.D"}},
        "0.E": {"enum": [{"$ref": "#/not/a/ref"}]},  # enum values are data, not schemas
    }


PYDANTIC_TOOL = {  # what Pydantic's model_json_schema() gives for a model with a nested model
    "type": "function",
    "function": {
        "name": "add_person",
        "parameters": {
            "$defs": {
                "Address": {
                    "properties": {"city": {"enum": ["Paris", "Rome"], "type": "string"}},
                    "required": ["city"],
                    "title": "Address",
                    "type": "object",
                }
            },
            "properties": {"name": {"maxLength": 5, "type": "string"}, "address": {"$ref": "#/$defs/Address"}},
            "required": ["name", "address"],
            "title": "Person",
            "type": "object",
        },
    },
}
OTHER_TOOL = {
    "type": "function",
    "function": {
        "name": "other",
        "parameters": {"$defs": {"Address": {"const": 1}}, "properties": {"a": {"$ref": "#/$defs/Address"}}},
    },
}


def test_prepared_schemas_stay_json():
    assert json.loads(json.dumps(prepare(PYDANTIC_TOOL["function"]["parameters"])))["x-guidance"] == {
        "whitespace_flexible": False
    }
