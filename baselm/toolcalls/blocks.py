"""Tool-call formats that wrap calls in blocks between an opening and a closing marker.

The same contract as `formats.py` (a pure reader of the answer so far; results for a
prefix are a prefix of the whole's). A block is read once it closes; one left open when the
answer ends is no call and its raw text becomes content. Spaces between blocks are no content.

- `qwen3_xml`: `<tool_call>` `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` `</tool_call>`
- `seed_oss`: the same inside `<seed:tool_call>` ... `</seed:tool_call>`
- `glm`: `<tool_call>` `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...` `</tool_call>`
- `minimax_m2`: `<minimax:tool_call>` `<invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...`
  `</minimax:tool_call>`
- `functionary_v3_1`: `<function=NAME>` JSON arguments `</function>`
- `kimi_k2`: `<|tool_calls_section_begin|>`
  `<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{...}<|tool_call_end|>...`
  `<|tool_calls_section_end|>`
- `tool_calls_json` (Apriel, MiniMax-M1): `<tool_calls>` a JSON array, or JSON objects one after
  another, of `{"name", "arguments"}` `</tool_calls>`
- `nemotron_json`: the same inside `<TOOLCALL>` ... `</TOOLCALL>`
- `cohere`: the same with `tool_name` and `parameters`, inside `<|START_ACTION|>` ... `<|END_ACTION|>`
- `lfm2`: `<|tool_call_start|>` a Python list of calls `[f(a=1), g(b="x")]` (literals only)
  `<|tool_call_end|>`
- `gemma4`: `<|tool_call>` `call:NAME{key:<|"|>text<|"|>,n:3}` `<tool_call|>`
- `minicpm5`: `<function name="NAME"><param name="KEY">VALUE</param>...</function>` (CDATA values too)
- `hunyuan_3`: `<tool_calls:opensource>` GLM-like calls with `:opensource` tags `</tool_calls:opensource>`
- `apertus`: `<|tools_prefix|>` a JSON array of `{NAME: ARGUMENTS}` `<|tools_suffix|>`
- `deepseek_v3_2`, `deepseek_v4`: `<｜DSML｜function_calls>` (V4: `tool_calls`)
  `<｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>...`

XML values are text: each is read as the type the tool's JSON schema gives it (JSON when it gives none).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from baselm.toolcalls.formats import Call, Parsed, add_after_calls, arguments_of, json_object, visible

Tools = Sequence[Mapping[str, Any]]
# Reads one block's inside into its calls; None when it is not calls in the format.
BlockReader = Callable[[str, Tools], list[Call] | None]


def read_blocks(text: str, final: bool, open_: str, close: str, read: BlockReader, tools: Tools) -> Parsed:
    """Content and calls of an answer whose calls sit in `open_` ... `close` blocks."""
    parsed, pos = Parsed(), 0
    while (start := text.find(open_, pos)) >= 0:
        between = text[pos:start]
        if not (parsed.calls and not between.strip()):
            parsed.content += between
        end = text.find(close, start + len(open_))
        if end < 0:  # still coming, or cut off (then shown as it is)
            if final:
                parsed.content += text[start:]
            return parsed
        calls = read(text[start + len(open_) : end], tools)
        if calls is None:
            parsed.content += text[start : end + len(close)]
        else:
            parsed.calls += calls
        pos = end + len(close)
    rest = visible(text[pos:], [open_], final)
    if parsed.calls:
        add_after_calls(parsed, rest)
    else:
        parsed.content += rest
    return parsed


def _property(tools: Tools, name: str, key: str) -> Mapping[str, Any]:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return ((function.get("parameters") or {}).get("properties") or {}).get(key) or {}
    return {}


def _typed(value: str, schema: Mapping[str, Any]) -> Any:
    """A parameter written as text, read as the type its schema gives (JSON when it says none)."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _pairs_call(name: str, pattern: re.Pattern[str], body: str, tools: Tools) -> Call | None:
    """A call whose body is only `pattern`'s (key, value) pairs; None when anything else is there."""
    name = name.strip()
    if not name or pattern.sub("", body).strip():
        return None
    return name, {k.strip(): _typed(v, _property(tools, name, k.strip())) for k, v in pattern.findall(body)}


_QWEN_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*)</function>\s*$", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>\s*', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)
_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
    r"<\|tool_call_end\|>\s*",
    re.DOTALL,
)


def _qwen_xml(inner: str, tools: Tools) -> list[Call] | None:
    match = _QWEN_FUNCTION.match(inner)
    call = _pairs_call(match.group(1), _QWEN_PARAMETER, match.group(2), tools) if match else None
    return [call] if call else None


def _glm(inner: str, tools: Tools) -> list[Call] | None:
    name, sep, body = inner.partition("<arg_key>")
    call = _pairs_call(name, _GLM_ARGUMENT, sep + body, tools)
    return [call] if call else None


def _repeated_calls(call: re.Pattern[str], pair: re.Pattern[str]) -> BlockReader:
    """A reader of blocks made only of `call` matches (name, body), each body only `pair` matches."""

    def read(inner: str, tools: Tools) -> list[Call] | None:
        found = call.findall(inner)
        if not found or call.sub("", inner).strip():
            return None
        calls = [_pairs_call(name, pair, body, tools) for name, body in found]
        return calls if all(calls) else None

    return read


def _functionary(inner: str, tools: Tools) -> list[Call] | None:
    name, sep, body = inner.partition(">")
    arguments, end = json_object(body)
    if not sep or not name.strip() or arguments is None or body[end:].strip():
        return None
    return [(name.strip(), arguments)]


def _kimi(inner: str, tools: Tools) -> list[Call] | None:
    found = _KIMI_CALL.findall(inner)
    if not found or _KIMI_CALL.sub("", inner).strip():
        return None
    calls = [(name, arguments_of(args.strip())) for name, args in found]
    return calls if all(a is not None for _, a in calls) else None


def _json_calls(name_key: str, arguments_key: str) -> BlockReader:
    """A reader of a JSON array of calls, or of JSON call objects one after another."""

    def read(inner: str, tools: Tools) -> list[Call] | None:
        items, pos, decoder = [], 0, json.JSONDecoder()
        while inner[pos:].strip():
            try:
                value, pos = decoder.raw_decode(inner, len(inner) - len(inner[pos:].lstrip()))
            except ValueError:
                return None
            items += value if isinstance(value, list) else [value]
        calls = [(c.get(name_key), arguments_of(c.get(arguments_key, {}))) for c in items if isinstance(c, dict)]
        valid = len(calls) == len(items) and all(isinstance(n, str) and a is not None for n, a in calls)
        return calls if items and valid else None

    return read


def _python_calls(inner: str, tools: Tools) -> list[Call] | None:
    """`[f(a=1), g(b="x")]` read as syntax, never run: only literal keyword arguments count."""
    try:
        tree = ast.parse(inner.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            calls.append((node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}))
        except ValueError:
            return None
    return calls or None


_DSML = "<｜DSML｜"
_DSML_INVOKE = re.compile(r'\s*<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>\s*', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'\s*<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>\s*', re.DOTALL
)


def _dsml(inner: str, tools: Tools) -> list[Call] | None:
    """DeepSeek V3.2+ invokes; a parameter marked string="false" holds JSON."""
    invokes = _DSML_INVOKE.findall(inner)
    if not invokes or _DSML_INVOKE.sub("", inner).strip():
        return None
    calls = []
    for name, body in invokes:
        if _DSML_PARAMETER.sub("", body).strip():
            return None
        try:
            arguments = {k: v if s == "true" else json.loads(v) for k, s, v in _DSML_PARAMETER.findall(body)}
        except ValueError:
            return None
        calls.append((name.strip(), arguments))
    return calls


_GEMMA_QUOTE = '<|"|>'
_GEMMA_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.\-]*)\s*:")


def _gemma4(inner: str, tools: Tools) -> list[Call] | None:
    """`call:NAME{key:<|"|>text<|"|>,n:3,flag:true}`: Gemma 4's own notation, rewritten as JSON to read it."""
    head, brace, rest = inner.partition("{")
    if not head.startswith("call:") or not brace:
        return None
    parts = ("{" + rest).split(_GEMMA_QUOTE)
    if len(parts) % 2 == 0:  # a string left open
        return None
    # Even parts are outside strings: bare keys get quotes, Python's None is null.
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\bNone\b", "null", _GEMMA_KEY.sub(r'\1"\2":', parts[i]))
    for i in range(1, len(parts), 2):
        parts[i] = json.dumps(parts[i], ensure_ascii=False)
    arguments, end = json_object("".join(parts))
    if arguments is None or "".join(parts)[end:].strip():
        return None
    return [(head[len("call:") :].strip(), arguments)]


_MINICPM_HEAD = re.compile(r'^([^"]+)">(.*)$', re.DOTALL)
_MINICPM_PARAMETER = re.compile(r'<param name="([^"]+)">(?:<!\[CDATA\[(.*?)\]\]>|(.*?))</param>', re.DOTALL)
_HY = ":opensource"
_HY_CALL = re.compile(rf"\s*<tool_call{_HY}>(.*?)<tool_sep{_HY}>(.*?)</tool_call{_HY}>\s*", re.DOTALL)
_HY_ARGUMENT = re.compile(rf"<arg_key{_HY}>(.*?)</arg_key{_HY}>\s*<arg_value{_HY}>(.*?)</arg_value{_HY}>", re.DOTALL)


def _minicpm(inner: str, tools: Tools) -> list[Call] | None:
    """`NAME"><param name="KEY">VALUE</param>...` (a value may be wrapped in CDATA)."""
    head = _MINICPM_HEAD.match(inner)
    if head is None or _MINICPM_PARAMETER.sub("", head.group(2)).strip():
        return None
    name = head.group(1).strip()
    found = _MINICPM_PARAMETER.findall(head.group(2))
    return [(name, {k: _typed(cdata or text, _property(tools, name, k)) for k, cdata, text in found})]


def _name_keyed(inner: str, tools: Tools) -> list[Call] | None:
    """A JSON array of `{NAME: ARGUMENTS}` objects (Apertus)."""
    try:
        items = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and len(i) == 1 for i in items):
        return None
    calls = [(name, arguments_of(args)) for item in items for name, args in item.items()]
    return calls if calls and all(a is not None for _, a in calls) else None


# format -> (opening marker, closing marker, block reader)
BLOCK_FORMATS: dict[str, tuple[str, str, BlockReader]] = {
    "qwen3_xml": ("<tool_call>", "</tool_call>", _qwen_xml),
    "seed_oss": ("<seed:tool_call>", "</seed:tool_call>", _qwen_xml),
    "glm": ("<tool_call>", "</tool_call>", _glm),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>", _repeated_calls(_MINIMAX_INVOKE, _MINIMAX_PARAMETER)),
    "functionary_v3_1": ("<function=", "</function>", _functionary),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _kimi),
    "tool_calls_json": ("<tool_calls>", "</tool_calls>", _json_calls("name", "arguments")),
    "nemotron_json": ("<TOOLCALL>", "</TOOLCALL>", _json_calls("name", "arguments")),
    "cohere": ("<|START_ACTION|>", "<|END_ACTION|>", _json_calls("tool_name", "parameters")),
    "lfm2": ("<|tool_call_start|>", "<|tool_call_end|>", _python_calls),
    "gemma4": ("<|tool_call>", "<tool_call|>", _gemma4),
    "deepseek_v3_2": (_DSML + "function_calls>", "</｜DSML｜function_calls>", _dsml),
    "deepseek_v4": (_DSML + "tool_calls>", "</｜DSML｜tool_calls>", _dsml),
    "minicpm5": ('<function name="', "</function>", _minicpm),
    "hunyuan_3": (f"<tool_calls{_HY}>", f"</tool_calls{_HY}>", _repeated_calls(_HY_CALL, _HY_ARGUMENT)),
    "apertus": ("<|tools_prefix|>", "<|tools_suffix|>", _name_keyed),
}


_INNER_MARKERS = {
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "gemma4": (_GEMMA_QUOTE,),
    "hunyuan_3": tuple(
        f"<{tag}{_HY}>"
        for tag in ("tool_call", "/tool_call", "tool_sep", "arg_key", "/arg_key", "arg_value", "/arg_value")
    ),
}


def block_markers(fmt: str) -> tuple[str, ...]:
    """The markers block format `fmt` writes: its block's opening and closing, and any inside."""
    open_, close, _ = BLOCK_FORMATS[fmt]
    return (open_, close, *_INNER_MARKERS.get(fmt, ()))


def block_reader(fmt: str) -> Callable[[str, bool, Tools], Parsed]:
    """The `formats.py`-style reader of block format `fmt`."""
    open_, close, read = BLOCK_FORMATS[fmt]

    def reader(text: str, final: bool, tools: Tools = ()) -> Parsed:
        return read_blocks(text, final, open_, close, read, tools)

    return reader
