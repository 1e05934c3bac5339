"""Reading tool calls out of a model's answer, one function per call format.

Each reader takes the answer so far and whether it is finished, and returns the answer's
content and its complete calls, in order: `Parsed(content, [(name, arguments), ...])`.

NOTE: a reader is a pure function of the text, and what it returns for a prefix of an answer
is a prefix of what it returns for the whole answer: content only grows at its end (text that
may still become a marker or a call is held back until the answer shows what it is), and a
call, once complete, stays one. `parsers.RereadingParser` relies on this to stream the difference.
A call that is not complete when the answer finishes (cut off, or broken JSON) is no call:
its raw text becomes content.

Formats:
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3) or
  `[TOOL_CALLS]name[ARGS]{...}` (v11, optionally `[CALL_ID]id` before `[ARGS]`), repeated.
- `granite_3` (Granite 3.x): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`.
- `harmony` (gpt-oss): messages `<|channel|>CHANNEL to=functions.NAME ...<|message|>{...}<|call|>`
  separated by `<|start|>assistant`; the `final` and `commentary` channels are content, the
  `analysis` channel is the model's reasoning and is left out.
- `deepseek` (V3, R1, V3.1): `<｜tool▁calls▁begin｜>` then calls
  `<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME(<｜tool▁sep｜>|\\n```json\\n)ARGS[```]<｜tool▁call▁end｜>`.

Formats that wrap calls in blocks (Qwen3-Coder XML, GLM, Kimi K2, ...) are in `blocks.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Call = tuple[str, dict[str, Any]]


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def visible(text: str, markers: Sequence[str], final: bool) -> str:
    """`text` less an end that may still grow into a marker (nothing held once the answer is finished)."""
    return text if final else text[: len(text) - held_back(text, markers)]


def json_object(text: str) -> tuple[dict[str, Any] | None, int]:
    """(the JSON object `text` starts with (after spaces), where it ends) or (None, 0)."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None, 0
    return (value, end) if isinstance(value, dict) else (None, 0)


def add_after_calls(parsed: Parsed, text: str) -> None:
    """Text after the last call is content unless it is only spaces (held, or dropped at the end)."""
    if text.strip():
        parsed.content += text


def arguments_of(value: Any) -> dict[str, Any] | None:
    """Call arguments as a dict: a dict, or a JSON string of one; None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


# ---- mistral ------------------------------------------------------------------------------

_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_GRANITE_CALLS = "<|tool_call|>"


def read_mistral(text: str, final: bool, tools: Sequence[Mapping[str, Any]] = ()) -> Parsed:
    return _read_after_marker(text, final, _MISTRAL_CALLS)


def read_granite(text: str, final: bool, tools: Sequence[Mapping[str, Any]] = ()) -> Parsed:
    return _read_after_marker(text, final, _GRANITE_CALLS)


def _read_after_marker(text: str, final: bool, marker: str) -> Parsed:
    """Calls after `marker`: a JSON array of calls, or (Mistral v11) `name[ARGS]{...}`; repeated."""
    start = text.find(marker)
    if start < 0:
        return Parsed(visible(text, [marker], final))
    parsed, pos = Parsed(text[:start]), start
    while text.startswith(marker, pos):
        body = text[pos + len(marker) :]
        calls, end = _mistral_array(body) if body.lstrip().startswith("[") else _mistral_named(body)
        if calls is None:  # still coming, or broken (then shown as it is once the answer ends)
            if final:
                parsed.content += text[pos:]
            return parsed
        parsed.calls += calls
        pos += len(marker) + end
        rest = text[pos:]
        if rest.lstrip().startswith(marker):  # spaces between calls are no content
            pos += len(rest) - len(rest.lstrip())
    add_after_calls(parsed, visible(text[pos:], [marker], final))
    return parsed


def _mistral_array(body: str) -> tuple[list[Call] | None, int]:
    start = len(body) - len(body.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(body, start)
    except ValueError:
        return None, 0
    items = value if isinstance(value, list) else []
    calls = [(c["name"], arguments_of(c.get("arguments", {}))) for c in items if isinstance(c, dict) and "name" in c]
    if not items or len(calls) != len(items) or any(a is None or not isinstance(n, str) for n, a in calls):
        return None, 0
    return calls, end


def _mistral_named(body: str) -> tuple[list[Call] | None, int]:
    head, sep, after = body.partition(_MISTRAL_ARGS)
    if not sep:
        return None, 0
    name = head.partition(_MISTRAL_ID)[0].strip()
    arguments, end = json_object(after)
    if not name or arguments is None:
        return None, 0
    return [(name, arguments)], len(head) + len(sep) + end


# ---- harmony (gpt-oss) --------------------------------------------------------------------

_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_MARKERS = (_H_START, _H_CHANNEL, _H_MESSAGE, *_H_ENDS)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def read_harmony(text: str, final: bool, tools: Sequence[Mapping[str, Any]] = ()) -> Parsed:
    parsed, pos = Parsed(), 0
    if _H_CHANNEL not in text and _H_MESSAGE not in text:  # no harmony message (yet): plain text
        parsed.content = visible(text, _H_MARKERS, final)
        return parsed
    while pos < len(text):
        header_end = text.find(_H_MESSAGE, pos)
        if header_end < 0:  # a header still coming; at the end, a lone next-message header is dropped
            if final and pos == 0:
                parsed.content += text
            return parsed
        header = text[pos:header_end]
        body_start = header_end + len(_H_MESSAGE)
        ends = [(i, m) for m in _H_ENDS if (i := text.find(m, body_start)) >= 0]
        body_end, end_marker = min(ends) if ends else (len(text), "")
        body = text[body_start:body_end]
        if not _read_harmony_message(parsed, header, body, bool(end_marker), final):
            if not (final or end_marker):
                return parsed  # a call's arguments still coming
            parsed.content += text[pos : body_end + len(end_marker)]  # a broken or cut-off call
        pos = body_end + len(end_marker)
        if text.startswith(_H_START, pos):
            pos += len(_H_START)
    return parsed


def _read_harmony_message(parsed: Parsed, header: str, body: str, closed: bool, final: bool) -> bool:
    """Adds one message's call or content; False for a call that is not (yet) complete.

    NOTE: a call counts once its message is closed (`<|call|>`, often a stop token and so
    absent: then at the end of the answer) and its body is one JSON object.
    """
    recipient = _RECIPIENT.search(header)
    if recipient is None:
        channel = header.partition(_H_CHANNEL)[2].split(" ")[0].strip()
        if channel != "analysis":  # the analysis channel is reasoning, not the answer
            parsed.content += body if closed else visible(body, _H_MARKERS, final)
        return True
    arguments, end = json_object(body)
    if arguments is None or body[end:].strip() or not (closed or final):
        return False
    parsed.calls.append((recipient.group(1), arguments))
    return True


# ---- deepseek -----------------------------------------------------------------------------

_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def read_deepseek(text: str, final: bool, tools: Sequence[Mapping[str, Any]] = ()) -> Parsed:
    start = text.find(_DS_CALLS)
    if start < 0:
        return Parsed(visible(text, [_DS_CALLS], final))
    parsed, pos = Parsed(text[:start]), start + len(_DS_CALLS)
    while True:
        rest = text[pos:].lstrip()
        pos = len(text) - len(rest)
        if rest.startswith(_DS_CALLS_END):
            parsed.content += visible(text[pos + len(_DS_CALLS_END) :], [], final)
            return parsed
        end = rest.find(_DS_CALL_END)
        call = _deepseek_call(rest[len(_DS_CALL) : end]) if rest.startswith(_DS_CALL) and end >= 0 else None
        if call is None:
            if final:  # cut off or broken: the rest (with the opening marker when no call came) is no call
                parsed.content += text[pos if parsed.calls else start :]
            return parsed
        parsed.calls.append(call)
        pos += end + len(_DS_CALL_END)


def _deepseek_call(inner: str) -> Call | None:
    left, sep, right = inner.partition(_DS_SEP)
    if not sep:
        return None
    if left.strip() == "function":  # V3/R1: function<sep>NAME\n```json\nARGS\n```
        name, _, right = right.partition("\n")
        fenced = _FENCE.match(right)
        right = fenced.group(1) if fenced else right
    else:  # V3.1: NAME<sep>ARGS
        name = left
    arguments, end = json_object(right)
    if not name.strip() or arguments is None or right[end:].strip():
        return None
    return name.strip(), arguments


# The markers of each format, as the tokenizer may hold them as (special) tokens.
MARKERS: dict[str, tuple[str, ...]] = {
    "mistral": (_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID),
    "granite_3": (_GRANITE_CALLS,),
    "harmony": (*_H_MARKERS, "<|constrain|>"),
    "deepseek": (_DS_CALLS, _DS_CALLS_END, _DS_CALL, _DS_CALL_END, _DS_SEP),
}
READERS: dict[str, Callable[..., Parsed]] = {
    "mistral": read_mistral,
    "granite_3": read_granite,
    "harmony": read_harmony,
    "deepseek": read_deepseek,
}
