"""JSON Schemas made ready for grammar-constrained decoding, so that a small model's answer ends.

A grammar only says what may come next; a model that never chooses to stop (a 135M model at
temperature 0 happily writes `1111111111...`) runs to max_tokens unless the grammar itself
ends. So, as OpenAI's strict structured outputs, llama.cpp and xgrammar do:

- JSON is compact: no whitespace between tokens (`{"a":1,"b":[2,3]}`). A schema whose top
  level carries llguidance's own `x-guidance` options (for example `"whitespace_flexible":
  true`) gets those instead.
- An object schema that lists `properties` takes no others unless it says so with
  `additionalProperties` or `patternProperties` (JSON Schema's default would allow any).
- Numbers are bounded in length where the schema leaves them open: at most 16 digits before
  the point (as llama.cpp's grammars) and 10 after it, no exponent.

`nest` places a schema inside a bigger one (a tool's parameters inside the forced-call
grammar) with its `$defs` hoisted to the root and its local `$ref`s rewritten, since
references resolve against the root.
"""

from __future__ import annotations

import copy
from typing import Any

COMPACT = {"whitespace_flexible": False}
MAX_INTEGER = 10**16 - 1  # 16 digits
NUMBER_STEP = 1e-10  # 10 digits after the point (llguidance reads multipleOf down to 1e-10 exactly)

_DEFS = ("$defs", "definitions")
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "dependentSchemas", *_DEFS)


def prepare(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """`schema` with closed objects, bounded numbers and compact whitespace (a new object)."""
    if isinstance(schema, bool):
        return schema
    options = schema.get("x-guidance")
    prepared = _walk(copy.deepcopy(schema), in_all_of=False)
    prepared["x-guidance"] = {**COMPACT, **(options if isinstance(options, dict) else {})}
    return prepared


def _walk(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    _close_object(schema, in_all_of)
    _bound_number(schema)
    for key in _ONE:
        if key in schema:
            schema[key] = _walk(schema[key], False)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            schema[key] = [_walk(s, key == "allOf") for s in schema[key]]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _walk(s, False) for name, s in schema[key].items()}
    return schema


def _close_object(schema: dict[str, Any], in_all_of: bool) -> None:
    # Inside allOf each part lists only some of the properties: closing one would forbid the others'.
    if in_all_of or "allOf" in schema or not isinstance(schema.get("properties"), dict):
        return
    if "additionalProperties" not in schema and "patternProperties" not in schema:
        schema["additionalProperties"] = False


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _bound_number(schema: dict[str, Any]) -> None:
    kinds = _types(schema)
    if not kinds & {"integer", "number"}:
        return
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -MAX_INTEGER
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = MAX_INTEGER
    if "number" in kinds and "multipleOf" not in schema:
        schema["multipleOf"] = NUMBER_STEP


# ---- a schema inside another --------------------------------------------------------------


def nest(schema: dict[str, Any], path: str, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`schema` to be placed at JSON pointer `path` of a bigger schema: returns it without its
    definitions, and those definitions renamed `prefix + name` for the bigger schema's root
    `$defs`. Its `#/$defs/X` (or `#/definitions/X`) refs point to the renamed ones; other
    local refs (`#`, `#/properties/...`) get `path` in front."""
    schema = copy.deepcopy(schema)
    defs: dict[str, Any] = {}
    for key in _DEFS:
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[prefix + name] = sub
    _rewrite_refs(schema, path, prefix)
    for sub in defs.values():
        _rewrite_refs(sub, path, prefix)
    return schema, defs


def _rewrite_refs(node: Any, path: str, prefix: str) -> None:
    if isinstance(node, list):
        for item in node:
            _rewrite_refs(item, path, prefix)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        node["$ref"] = _rewritten(ref, path, prefix)
    for key, value in node.items():
        if key not in ("const", "enum", "default", "examples"):  # values, not schemas
            _rewrite_refs(value, path, prefix)


def _rewritten(ref: str, path: str, prefix: str) -> str:
    for key in _DEFS:
        head = f"#/{key}/"
        if ref.startswith(head):
            name = ref[len(head) :]
            escaped = prefix.replace("~", "~0").replace("/", "~1")
            return f"#/$defs/{escaped}{name}"
    return "#" + path + ref[1:]
