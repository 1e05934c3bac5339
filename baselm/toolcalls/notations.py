"""Call arguments in a notation of their own instead of JSON, as grammar: Gemma 4's and LFM2's.

Gemma 4's template writes a call's arguments `{key:<|"|>text<|"|>,n:3,on:true,tags:[<|"|>a<|"|>]}` (keys
bare and in sorted order, strings between `<|"|>` markers); LFM2.5's writes a Python call
`NAME(key='text', n=3, on=True)` (keyword arguments in the tool's order, Python literals). `Notation`
holds what tells the two apart, and `ArgumentsGrammar` turns a tool's JSON Schema into the grammar of
its arguments in one of them, so that whatever the grammar allows is read back by the format's reader
(blocks.py) into arguments the schema accepts.

The JSON Schema a notation is held to (forcing a call of a tool whose schema says more is refused by
name with a ToolCallError, since leaving a keyword out could force arguments the tool does not take):
- `type` (one or a list), `enum`, `const`, `anyOf` and `oneOf` (as alternatives: a value two branches
  of a oneOf both match is not kept out), an `allOf` of one schema, local `$ref`s (recursion too);
- strings: `minLength`, `maxLength`, `pattern` (matched whole, which also satisfies it as a search),
  `format` date, time, date-time and uuid (other formats are annotations, as JSON Schema reads them);
  a string never holds the text of a marker that would end it or its call early, and LFM2's strings
  with a pattern or format hold no character that needs an escape;
- numbers and integers: all of JSON's (both notations write numbers as JSON does, and the number
  grammar is llguidance's JSON one, bounded as json_schemas.py bounds it);
- arrays: `items`, `prefixItems` (exactly those items), `minItems`, `maxItems`;
- objects: `properties` with `required` (only the listed properties are written: an open object's
  other keys are allowed, never needed), or with no `properties` a map whose keys are names the
  notation writes bare (`additionalProperties` giving its values' schema);
- annotations (`description`, `title`, `default`, `examples`, ...) and `x-` extensions are ignored.
A property key the notation cannot write (a Python keyword in LFM2's call, a marker's text) may only
be left out: a required one is refused by name.
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baselm.structured import json_schemas
from baselm.toolcalls.errors import ToolCallError

Schema = Mapping[str, Any]
_ANNOTATIONS = frozenset(
    {
        "description", "title", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
        "writeOnly", "contentEncoding", "contentMediaType", "nullable", "$defs", "definitions",
        "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "format",
    }
)  # fmt: skip
_SUPPORTED = frozenset(
    {
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "items", "prefixItems",
        "minItems", "maxItems", "properties", "required",
    }
)  # fmt: skip
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}


@dataclass(frozen=True, slots=True)
class Notation:
    """How one notation writes values: its literals, separators, strings and keys.

    `forbidden`: texts no string may hold (its own quote, the marker that closes a call), since the
    reader would end the string or the call there. `quote`: Gemma 4's string marker, which may be a
    special token; "" where strings are Python's `'...'`.
    """

    name: str
    true: str
    false: str
    null: str
    key_sep: str  # between a key and its value in an object
    item_sep: str  # between two items of an array or object
    sorted_keys: bool  # objects write their keys sorted (Gemma 4's template sorts them)
    forbidden: tuple[str, ...]
    quote: str = ""

    def string(self, value: str) -> str | None:
        """`value` as a string literal; None when it holds a forbidden text."""
        if any(f in value for f in self.forbidden):
            return None
        if self.quote:
            return self.quote + value + self.quote
        escaped = value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
        return "'" + re.sub(r"[\x00-\x08\x0b-\x1f]", lambda m: f"\\x{ord(m.group()):02x}", escaped) + "'"

    def key(self, key: str) -> str | None:
        """`key` as an object writes it; None when it cannot be written."""
        if self.quote and _GEMMA_BARE_KEY.fullmatch(key) and not re.search(r"\bNone\b", key):
            return key
        return self.string(key)

    def value(self, value: Any) -> str | None:
        """Any JSON value as a literal; None when part of it cannot be written."""
        if isinstance(value, bool):
            return self.true if value else self.false
        if value is None:
            return self.null
        if isinstance(value, (int, float)):
            return json.dumps(value)
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, list):
            items = [self.value(v) for v in value]
            return None if None in items else "[" + self.item_sep.join(items) + "]"  # type: ignore[arg-type]
        if isinstance(value, dict):
            keys = sorted(value, key=str.lower) if self.sorted_keys else list(value)
            pairs = [(self.key(k), self.value(value[k])) for k in keys]
            if any(k is None or v is None for k, v in pairs):
                return None
            return "{" + self.item_sep.join(f"{k}{self.key_sep}{v}" for k, v in pairs) + "}"
        return None


# The keys Gemma 4's reader (blocks.py) reads bare; others are written as strings.
_GEMMA_BARE_KEY = re.compile(r"[A-Za-z_][\w.\-]*")
GEMMA4 = Notation("gemma4", "true", "false", "None", ":", ",", True, ('<|"|>', "<tool_call|>"), quote='<|"|>')
PYTHON = Notation("lfm2", "True", "False", "None", ": ", ", ", False, ("<|tool_call_end|>",))


def _regex(pattern: str) -> str:
    """A regex as a Lark `/.../` expression."""
    return "/" + pattern.replace("/", "\\/") + "/"


def _escaped(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


class Rules:
    """The named rules a grammar gathers as it is written, and its literals: `rules(text)` is `text` as
    an expression (`lit`'s: special markers as their tokens). A name in capitals is a terminal (one
    lexeme), others are rules."""

    def __init__(self, lit: Callable[[str], str]) -> None:
        self.lit = lit
        self.bodies: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        return self.lit(text)

    def reserve(self, hint: str) -> str:
        """A new name (a terminal's when `hint` is in capitals), its body to be defined."""
        name = f"{hint}_{len(self.bodies)}" if hint.isupper() else f"n{len(self.bodies)}_{hint}"
        self.bodies[name] = '""'
        return name

    def define(self, name: str, body: str) -> None:
        self.bodies[name] = body

    def add(self, body: str, hint: str) -> str:
        """`body` under a new name, which is returned."""
        name = self.reserve(hint)
        self.define(name, body)
        return name

    def text(self) -> str:
        return "".join(f"{name}: {body}\n" for name, body in self.bodies.items())


class ArgumentsGrammar:
    """The grammar of one tool's arguments in a notation, written into `rules`.

    NOTE: a `$ref` becomes a rule of its own before its target is written, so a recursive schema
    refers to itself through the rule's name.
    """

    def __init__(self, notation: Notation, root: Schema, rules: Rules) -> None:
        self.notation, self.root, self.rules, self.lit = notation, root, rules, rules
        self._refs: dict[str, str] = {}

    def value(self, schema: Any, where: str) -> str:
        """The grammar of a value `schema` accepts, at JSON pointer `where` of the parameters (for errors)."""
        if schema is True or schema == {}:
            return self._any()
        if not isinstance(schema, Mapping):
            raise self._error(where, "is not a schema")
        self._check_keywords(schema, _SUPPORTED, where)
        if schema.get("nullable") is True:  # OpenAPI's way of saying "or null"
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return self._alternatives([self.value(rest, where), self.lit(self.notation.null)], where)
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema or "enum" in schema:
            return self._choice(schema, where)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema:
                return self._branches(schema, key, where)
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return self._alternatives([self._typed({**schema, "type": k}, where) for k in kinds], where)
        if kinds is None:
            return self._untyped(schema, where)
        return self._typed(schema, where)

    def pairs(self, schema: Schema, key_sep: str, item_sep: str, where: str, python_names: bool = False) -> str:
        """An object's listed properties as `key key_sep value` pieces joined by `item_sep` (without the
        braces): required ones always, each other one or not, in the notation's key order.
        `python_names`: keys are written bare as Python keyword arguments."""
        self._check_keywords(schema, frozenset({"type", "properties", "required"}), where)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        keys = sorted(properties, key=str.lower) if self.notation.sorted_keys else list(properties)
        pieces = []
        for key in keys:
            written = _python_name(key) if python_names else self.notation.key(key)
            if written is None:
                if key in required:
                    raise self._error(
                        f"{where}/properties/{key}", f"is a key the {self.notation.name} notation cannot write"
                    )
                continue
            value = self.value(properties[key], f"{where}/properties/{key}")
            pieces.append((self.rules.add(f"{self.lit(written + key_sep)} {value}", "pair"), key in required))
        missing = required - set(properties)
        if missing:
            raise self._error(where, f"requires {sorted(missing)[0]!r}, which it does not describe")
        return _ordered(pieces, self.lit(item_sep))

    def _check_keywords(self, schema: Schema, supported: frozenset[str], where: str) -> None:
        unknown = [k for k in schema if k not in supported and k not in _ANNOTATIONS and not k.startswith("x-")]
        if unknown:
            raise self._error(where, f"uses {unknown[0]!r}")

    # ---- by kind -------------------------------------------------------------------------

    def _typed(self, schema: Schema, where: str) -> str:
        kind = schema["type"]
        n = self.notation
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            leaf = {"type": kind, **{k: schema[k] for k in _NUMBER_KEYS if k in schema}}
            return f"%json {json.dumps(json_schemas.prepare(leaf))}"
        if kind == "boolean":
            return f"({self.lit(n.true)} | {self.lit(n.false)})"
        if kind == "null":
            return self.lit(n.null)
        if kind == "array":
            return self._array(schema, where)
        if kind == "object":
            return self._object(schema, where)
        raise self._error(where, f"has type {kind!r}")

    def _untyped(self, schema: Schema, where: str) -> str:
        """A schema with no type: the kinds its keywords describe, or any value."""
        if "properties" in schema:
            return self._object(schema, where)
        if "items" in schema or "prefixItems" in schema:
            return self._array(schema, where)
        if any(k in schema for k in ("minLength", "maxLength", "pattern")):
            return self._string(schema, where)
        if any(k in schema for k in _NUMBER_KEYS):
            return self._typed({**schema, "type": "number"}, where)
        return self._any()

    def _string(self, schema: Schema, where: str) -> str:
        n, low, high = self.notation, int(schema.get("minLength") or 0), schema.get("maxLength")
        if high is not None and int(high) < low:
            raise self._error(where, "allows no string (maxLength below minLength)")
        size = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
        shape = schema.get("pattern")
        fmt = FORMATS.get(schema.get("format", ""))
        if shape and fmt:
            raise self._error(where, "has both a pattern and a format")
        shape = shape or fmt
        if shape is not None:
            shape = shape[1:] if shape.startswith("^") else shape
            shape = shape[:-1] if shape.endswith("$") and not shape.endswith("\\$") else shape
        if n.quote:
            body = _regex(f"(?s:.){size}")
        elif shape is None:
            body = _regex(rf"(?:[^'\\\x00-\x08\x0a-\x1f]|\\['\\nrt]){size}")
        else:
            body = _regex(rf"[^'\\\x00-\x08\x0a-\x1f]{size}")
        parts = [body, "~" + _regex("(?s:.*)(?:" + "|".join(_escaped(f) for f in n.forbidden) + ")(?s:.*)")]
        if shape is not None:
            parts.append(_regex(f"(?:{shape})"))
        text = " & ".join(parts)
        if not n.quote:
            return self.rules.add(f"/'/ ({text}) /'/", "STRING")
        quote = self.lit(n.quote)
        if quote.startswith("<["):  # the quote is a special token: it ends the text by itself
            return f"{quote} {self.rules.add(text, 'STRING')} {quote}"
        # The quote's own characters may stand in a string: the text and its closing quote are one
        # lexeme, which ends at the first quote.
        return f"{quote} {self.rules.add(f'({text}) {quote}', 'STRING')}"

    def _array(self, schema: Schema, where: str) -> str:
        sep, low, high = self.lit(self.notation.item_sep), int(schema.get("minItems") or 0), schema.get("maxItems")
        if "prefixItems" in schema:
            fixed = [self.value(s, f"{where}/prefixItems/{i}") for i, s in enumerate(schema["prefixItems"])]
            if low > len(fixed) or (high is not None and int(high) < len(fixed)):
                raise self._error(where, "has prefixItems that minItems or maxItems do not fit")
            return f'"[" {f" {sep} ".join(fixed)} "]"' if fixed else '"[" "]"'
        item = self.rules.add(self.value(schema.get("items", True), f"{where}/items"), "item")
        if high is not None and int(high) < max(low, 1):
            if int(high) < low:
                raise self._error(where, "allows no array (maxItems below minItems)")
            return '"[" "]"'
        more = f"{{{max(low - 1, 0)},{int(high) - 1}}}" if high is not None else f"{{{max(low - 1, 0)},}}"
        items = f"{item} ({sep} {item}){more}" if more != "{0,0}" else item
        return f'"[" {items} "]"' if low else f'"[" ({items})? "]"'

    def _object(self, schema: Schema, where: str) -> str:
        if "properties" in schema:
            pairs = self.pairs(schema, self.notation.key_sep, self.notation.item_sep, where)
            return f'"{{" {pairs} "}}"' if pairs else '"{" "}"'
        values = schema.get("additionalProperties", True)
        if values is False:
            return '"{" "}"'
        value = self.value(values, f"{where}/additionalProperties")
        pair = self.rules.add(f"{self._map_key()} {self.lit(self.notation.key_sep)} {value}", "entry")
        return f'"{{" ({pair} ({self.lit(self.notation.item_sep)} {pair})*)? "}}"'

    def _map_key(self) -> str:
        """A key of a map (an object with no listed properties), as a name the notation writes bare."""
        if self.notation.quote:
            return self.rules.add(r"/[A-Za-z_][A-Za-z0-9_]*/ & ~/None/", "KEY")
        return self.rules.add(r"/'[A-Za-z_][A-Za-z0-9_]*'/", "KEY")

    def _any(self) -> str:
        """Any value: what a schema of `true` or `{}` accepts."""
        if "any" not in self._refs:
            self._refs["any"] = name = self.rules.reserve("any")
            kinds = ["string", "number", "boolean", "null", "array", "object"]
            self.rules.define(name, " | ".join(self._typed({"type": k}, "") for k in kinds))
        return self._refs["any"]

    # ---- combinations ---------------------------------------------------------------------

    def _choice(self, schema: Schema, where: str) -> str:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        kinds = schema.get("type")
        if kinds is not None:  # both must hold
            kinds = kinds if isinstance(kinds, list) else [kinds]
            values = [v for v in values if any(_is_type(v, k) for k in kinds)]
        written = [self.notation.value(v) for v in values]
        return self._alternatives([self.lit(w) for w in written if w is not None], where)

    def _branches(self, schema: Schema, key: str, where: str) -> str:
        branches = schema[key]
        if key == "allOf" and len(branches) != 1:
            raise self._error(where, "uses 'allOf' of more than one schema")
        return self._alternatives([self.value(s, f"{where}/{key}/{i}") for i, s in enumerate(branches)], where)

    def _alternatives(self, options: Sequence[str], where: str) -> str:
        if not options:
            raise self._error(where, f"allows no value the {self.notation.name} notation can write")
        return "(" + " | ".join(options) + ")" if len(options) > 1 else options[0]

    def _ref(self, ref: str, where: str) -> str:
        if ref not in self._refs:
            self._refs[ref] = name = self.rules.reserve("ref")  # named first: the target may refer to it
            self.rules.define(name, self.value(self._resolve(ref, where), ref))
        return self._refs[ref]

    def _resolve(self, ref: str, where: str) -> Any:
        if not ref.startswith("#"):
            raise self._error(where, f"refers to {ref!r}, outside the tool's parameters")
        node: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise self._error(where, f"refers to {ref!r}, which is not there")
            node = node[part]
        return node

    def _error(self, where: str, what: str) -> ToolCallError:
        place = f"parameters{where}" if where else "parameters"
        return ToolCallError(
            f"a call cannot be forced in the {self.notation.name} format for this tool: its {place} {what}, "
            f"which the {self.notation.name} notation cannot hold a call to; use tool_choice 'auto'",
            "tools",
        )


def _is_type(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    kinds = {"number": (int, float), "string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}
    return isinstance(value, kinds.get(kind, ()))


def _python_name(key: str) -> str | None:
    """`key` as a Python keyword argument; None when Python cannot name it."""
    return key if key.isidentifier() and not keyword.iskeyword(key) else None


def _ordered(pieces: Sequence[tuple[str, bool]], sep: str) -> str:
    """`pieces` (expression, required) in order, each optional one there or not, joined by `sep`:
    one alternative per piece that can come first."""
    if not pieces:
        return ""
    first_required = next((i for i, (_, required) in enumerate(pieces) if required), len(pieces))

    def tail(start: int) -> str:
        return " ".join(f"{sep} {p}" if req else f"({sep} {p})?" for p, req in pieces[start:])

    options = [f"{pieces[i][0]} {tail(i + 1)}".strip() for i in range(min(first_required + 1, len(pieces)))]
    body = options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"
    return body if first_required < len(pieces) else f"({body})?"
