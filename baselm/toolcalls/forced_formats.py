"""Forced-call grammars for the formats beyond `hermes` and `llama3_json` (forcing.py has those).

Each format is written as its model's template writes a call, so a forced answer is what the
model would say, and what the format's reader (formats.py, blocks.py) reads back:

- JSON arguments: `mistral` (v3 `[TOOL_CALLS][{...}]`, or v11 `[TOOL_CALLS]NAME[ARGS]{...}` when
  the template writes `[ARGS]`), `granite_3`, `deepseek` (V3/R1 with a ```json fence, V3.1
  without, as the template writes it), `kimi_k2`, `tool_calls_json`, `nemotron_json`, `cohere`,
  `functionary_v3_1`, `apertus`, and gpt-oss's `harmony` (one `commentary to=functions.NAME`
  message, whose closing `<|call|>` is a stop token);
- XML parameters: `qwen3_xml`, `seed_oss`, `glm`, `minimax_m2`, `minicpm5`, `hunyuan_3` (GLM's with
  `:opensource` tags), DeepSeek V3.2/V4's
  DSML (`deepseek_v3_2`, `deepseek_v4`, which mark each value `string="true|false"`): a value is its text
  when the schema makes it a string (an enum's values, or text up to the closing tag, of
  `minLength` to `maxLength` characters), else JSON that follows its schema. Required parameters come in the
  schema's order, then each optional one may follow.
- a notation of their own (notations.py): `gemma4` (`<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>`,
  one block per call) and `lfm2` (`<|tool_call_start|>[NAME(key='text'), ...]<|tool_call_end|>`, a
  Python list of calls).

`literal` writes a marker that the vocabulary holds as one special token as that token (`<[id]>`),
since the model writes the token and llguidance matches no text against a special token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from baselm.structured import json_schemas
from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.notations import GEMMA4, PYTHON, ArgumentsGrammar, Rules

Tool = Mapping[str, Any]
# (name, its JSON arguments as a grammar expression) -> one call as a grammar expression
CallWriter = Callable[[str, str], str]


def literal(text: str, marker_ids: Mapping[str, int]) -> str:
    """`text` as a grammar expression: its special markers as their tokens, the rest as strings."""
    parts, pos = [], 0
    while pos < len(text):
        found = [(text.find(m, pos), m) for m in marker_ids if text.find(m, pos) >= 0]
        start, marker = min(found) if found else (len(text), "")
        if start > pos:
            parts.append(json.dumps(text[pos:start]))
        if marker:
            parts.append(f"<[{marker_ids[marker]}]>")
        pos = start + len(marker)
    return " ".join(parts) or '""'


class Writer:
    """How one format writes its calls: what comes before the first, between two and after the last.

    `end`: the text that ends each call after its last argument (`}<tool_call|>`, `)`), where one
    token may run past it into the next call (nothing stands between two calls, or a token like
    `), ` holds the separator): `forcing.RepeatStop` keeps a call that can end as a repeat from
    running on. NOTE: no format's `end` depends on its template's variant.
    """

    def __init__(
        self, call: Callable[..., str], before: str = "", between: str = "", after: str = "", end: str = ""
    ) -> None:
        self.call, self.before, self.between, self.after, self.end = call, before, between, after, end


def _json_object(name_key: str, args_key: str, id_key: str | None = None) -> Callable[..., str]:
    """`{"name_key": NAME, "args_key": ARGS}` (with `"id_key": "N"` first, as Cohere writes)."""

    def call(name: str, args: str, lit: Callable[[str], str], _: Tool) -> str:
        head = lit("{" + json.dumps(id_key) + ': "') + " /[0-9]/ " + lit('", ') if id_key else lit("{")
        pairs = f"{json.dumps(name_key)}: {json.dumps(name)}, {json.dumps(args_key)}: "
        return f'{head} {lit(pairs)} {args} "}}"'

    return call


def _around(head: str, middle: str, tail: str, index: str = "") -> Callable[..., str]:
    """head NAME middle ARGS tail; with `index`, head NAME index N middle ARGS tail (Kimi's `:0`)."""

    def call(name: str, args: str, lit: Callable[[str], str], _: Tool) -> str:
        if index:
            return f"{lit(head + name + index)} /[0-9]/ {lit(middle)} {args} {lit(tail)}"
        return f"{lit(head + name + middle)} {args} {lit(tail)}"

    return call


def _apertus(name: str, args: str, lit: Callable[[str], str], _: Tool) -> str:
    return f'{lit("{" + json.dumps(name) + ": ")} {args} "}}"'


def _xml(
    head: str, name_end: str, param: str, sep: str | Callable[[Mapping[str, Any]], str], close_param: str, tail: str
) -> Callable[..., str]:
    """head NAME name_end, then per parameter `param KEY sep VALUE close_param`, then tail (`sep` may
    depend on the parameter's schema)."""

    def call(name: str, _: str, lit: Callable[[str], str], tool: Tool) -> str:
        schema = tool["function"].get("parameters") or {}
        properties = schema.get("properties") or {}
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        required = [k for k in properties if k in set(schema.get("required") or ())]
        pieces = []
        for key in [*required, *(k for k in properties if k not in required)]:
            between = sep(properties[key]) if callable(sep) else sep
            value = _xml_value(properties[key], defs)
            piece = f"{lit(param + key + between)} {value} {lit(close_param)}"
            pieces.append(piece if key in required else f"({piece})?")
        return " ".join([lit(head + name + name_end), *pieces, lit(tail)])

    return call


def _is_text(schema: Mapping[str, Any]) -> bool:
    """Whether a parameter's value is written as its text (a string), not as JSON."""
    values = schema.get("enum")
    if values:
        return all(isinstance(v, str) for v in values)
    return schema.get("type") == "string"


def _dsml(tag: str) -> Writer:
    """DeepSeek V3.2 (`function_calls`) and V4 (`tool_calls`): a parameter says whether it is text."""
    call = _xml(
        '<｜DSML｜invoke name="',
        '">',
        '\n<｜DSML｜parameter name="',
        lambda schema: f'" string="{"true" if _is_text(schema) else "false"}">',
        "</｜DSML｜parameter>",
        "\n</｜DSML｜invoke>",
    )
    return Writer(call, f"<｜DSML｜{tag}>\n", "\n", f"\n</｜DSML｜{tag}>")


def _xml_value(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    """A parameter's value: its text where the schema makes it a string (no `<`, which would start
    the closing tag), else JSON that follows its schema (with the tool's definitions `defs`, which
    its refs name, and its numbers bounded as json_schemas.py bounds them)."""
    values = schema.get("enum")
    if values and _is_text(schema):
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    if _is_text(schema):
        least, most = int(schema.get("minLength") or 0), schema.get("maxLength")
        return f"/[^<]{{{least},{int(most)}}}/" if isinstance(most, int) else f"/[^<]{{{least},}}/"
    return f"%json {json.dumps(json_schemas.prepare({**schema, **defs}))}"


def _gemma4(name: str, _: str, rules: Rules, tool: Tool) -> str:
    """`<|tool_call>call:NAME{...}<tool_call|>`: the arguments in Gemma 4's own notation."""
    if "{" in name or any(f in name for f in GEMMA4.forbidden):
        raise ToolCallError(f"a call of {name!r} cannot be forced in the gemma4 format: its name holds '{{'", "tools")
    schema = tool["function"].get("parameters") or {}
    pairs = ArgumentsGrammar(GEMMA4, schema, rules).pairs(schema, GEMMA4.key_sep, GEMMA4.item_sep, "")
    return f"{rules('<|tool_call>call:' + name + '{')} {pairs} {rules('}<tool_call|>')}"


def _python_call(name: str, _: str, rules: Rules, tool: Tool) -> str:
    """`NAME(key='text', n=3)`: LFM2's Python call, keyword arguments as Python literals."""
    if not name.isidentifier():
        raise ToolCallError(f"a call of {name!r} cannot be forced in the lfm2 format: Python cannot name it", "tools")
    schema = tool["function"].get("parameters") or {}
    pairs = ArgumentsGrammar(PYTHON, schema, rules).pairs(schema, "=", PYTHON.item_sep, "", python_names=True)
    return f"{rules(name + '(')} {pairs} {rules(')')}"


def _mistral(template: str) -> Writer:
    if "[ARGS]" in template:  # v11 (Mistral Small 3.2, Devstral, Magistral): one marker per call
        return Writer(_around("[TOOL_CALLS]", "[ARGS]", ""))
    return Writer(_json_object("name", "arguments"), "[TOOL_CALLS][", ", ", "]")


def _deepseek(template: str) -> Writer:
    calls, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    if "```json" in template:  # V3, R1: a type, the name, then a fenced JSON block
        call = _around("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>")
    else:  # V3.1
        call = _around("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
    return Writer(call, calls, "\n", calls_end)


_CALL = _json_object("name", "arguments")
ONE_CALL = frozenset({"harmony"})  # formats whose answer holds one call at most
WRITERS: dict[str, Callable[[str], Writer]] = {
    "mistral": _mistral,
    "granite_3": lambda t: Writer(_CALL, "<|tool_call|>[", ", ", "]"),
    "deepseek": _deepseek,
    "kimi_k2": lambda t: Writer(
        _around("<|tool_call_begin|>functions.", "<|tool_call_argument_begin|>", "<|tool_call_end|>", index=":"),
        "<|tool_calls_section_begin|>",
        "",
        "<|tool_calls_section_end|>",
    ),
    "tool_calls_json": lambda t: Writer(_CALL, "<tool_calls>[", ", ", "]</tool_calls>"),
    "nemotron_json": lambda t: Writer(_CALL, "<TOOLCALL>[", ", ", "]</TOOLCALL>"),
    "cohere": lambda t: Writer(
        _json_object("tool_name", "parameters", "tool_call_id"), "<|START_ACTION|>[", ", ", "]<|END_ACTION|>"
    ),
    "functionary_v3_1": lambda t: Writer(_around("<function=", ">", "</function>")),
    # One call a turn: its closing <|call|> is a stop token, which the answer's end stands for.
    "harmony": lambda t: Writer(_around("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "")),
    "apertus": lambda t: Writer(_apertus, "<|tools_prefix|>[", ", ", "]<|tools_suffix|>"),
    "qwen3_xml": lambda t: Writer(
        _xml("<tool_call>\n<function=", ">", "\n<parameter=", ">\n", "\n</parameter>", "\n</function>\n</tool_call>"),
        between="\n",
    ),
    "seed_oss": lambda t: Writer(
        _xml(
            "<seed:tool_call>\n<function=",
            ">",
            "\n<parameter=",
            ">",
            "</parameter>",
            "\n</function>\n</seed:tool_call>",
        ),
        between="\n",
    ),
    "glm": lambda t: Writer(
        _xml("<tool_call>", "", "\n<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>", "\n</tool_call>"),
        between="\n",
    ),
    "deepseek_v3_2": lambda t: _dsml("function_calls"),
    "deepseek_v4": lambda t: _dsml("tool_calls"),
    "minicpm5": lambda t: Writer(
        _xml('<function name="', '">', '<param name="', '">', "</param>", "</function>"), between="\n"
    ),
    "hunyuan_3": lambda t: Writer(
        _xml(
            "<tool_call:opensource>",
            "<tool_sep:opensource>\n",
            "<arg_key:opensource>",
            "</arg_key:opensource>\n<arg_value:opensource>",
            "</arg_value:opensource>\n",
            "</tool_call:opensource>\n",
        ),
        "<tool_calls:opensource>\n",
        "",
        "</tool_calls:opensource>",
        end="</tool_call:opensource>\n",
    ),
    "gemma4": lambda t: Writer(_gemma4, end="}<tool_call|>"),
    "lfm2": lambda t: Writer(_python_call, "<|tool_call_start|>[", ", ", "]<|tool_call_end|>", end=")"),
    "minimax_m2": lambda t: Writer(
        _xml(
            '<minimax:tool_call>\n<invoke name="',
            '">',
            '\n<parameter name="',
            '">',
            "</parameter>",
            "\n</invoke>\n</minimax:tool_call>",
        ),
        between="\n",
    ),
}


def format_lark(
    fmt: str,
    tools: list[Tool],
    parallel: bool,
    template: str,
    marker_ids: Mapping[str, int],
    arguments: Callable[[int], str],
) -> str:
    """The Lark grammar of forced calls of `tools` in `fmt`; `arguments(i)` names the rule of tool i's
    JSON arguments (forcing.py writes those rules)."""
    writer = WRITERS[fmt](template)
    lit = Rules(lambda text: literal(text, marker_ids))
    calls = " | ".join(
        f"({writer.call(tool['function']['name'], arguments(i), lit, tool)})" for i, tool in enumerate(tools)
    )
    repeat = f" ({lit(writer.between) if writer.between else ''} call)*" if parallel and fmt not in ONE_CALL else ""
    before = f"{lit(writer.before)} " if writer.before else ""
    after = f" {lit(writer.after)}" if writer.after else ""
    return f"start: {before}call{repeat}{after}\ncall: {calls}\n" + lit.text()
