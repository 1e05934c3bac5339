"""Schemas and tools the structured-output and tool-call tests share, and a validator of the
subset of JSON Schema they use."""

from __future__ import annotations

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


def validate(value, schema) -> None:
    """The subset of JSON Schema these tests use; raises AssertionError on a mismatch."""
    if "const" in schema:
        assert value == schema["const"], (value, schema["const"])
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
    if "anyOf" in schema:
        assert any(_valid(value, branch) for branch in schema["anyOf"]), (value, schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        assert any(_valid(value, {**schema, "type": k}) for k in kind), (value, kind)
    elif kind == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", [])) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub)
    elif kind in ("integer", "number"):
        assert isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "string":
        assert isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get(
            "maxLength", len(value)
        )
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "null":
        assert value is None
    elif kind == "array":
        assert isinstance(value, list)
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            validate(item, schema["items"])


def _valid(value, schema) -> bool:
    try:
        validate(value, schema)
    except AssertionError:
        return False
    return True
