"""Tool calls: which format a model writes, parsing it into OpenAI `tool_calls`, forcing it by grammar.

Two formats are understood:

- `hermes` (Hermes, Qwen 2/2.5/3 and any template that mentions `<tool_call>`):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1+ templates): the whole answer is `{"name": ..., "parameters": {...}}`,
  several calls separated by `;`.

One `ToolCallParser` reads the text for both the streamed and the whole answer, so a stream's
deltas reassemble to exactly the non-streamed result. Content outside calls streams as it
comes; a call is sent as soon as it closes (its id, type and name in one delta, its
arguments in the next). A call that never closes (the answer ran out of tokens, or the JSON
is broken) is not a call, and neither is one that repeats an earlier call exactly (a small
model may call the same thing again and again; `RepeatStop` ends such an answer when calls are
forced). When calls are forced (tool_choice required or named), the grammar
allows nothing but calls, so such a rest is dropped: the answer ends with the calls that
closed and the engine's finish reason ("length"). Otherwise it may be plain text that only
looks like a call, and is returned as content. Text parsed into a call is never content.
"""

from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np

from baselm.structured import json_schemas
from baselm.structured.grammar import GrammarProcessor
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.errors import ToolCallError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def tool_format(chat_template: str | dict[str, str] | None) -> str:
    """The call format a chat template teaches its model (hermes when the template does not say).

    Read from the template's markers by `tool_parsers.detect_format`, which knows the other formats.
    """
    from baselm.toolcalls.parsers import detect_format  # tool_parsers builds on this module

    return detect_format(chat_template)


@dataclass(slots=True)
class ToolCall:
    """One parsed call: its place among the answer's calls, an id for the tool result, name, arguments."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_deltas(self) -> list[dict[str, Any]]:
        """The call streamed in two deltas: its id, type and name, then its arguments."""
        head = {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }
        return [head, {"index": self.index, "function": {"arguments": self.arguments}}]


def _call_from_json(text: str, index: int) -> ToolCall | None:
    """A call from one JSON object with a name and arguments (or parameters); None when it is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(index, f"call_{secrets.token_hex(12)}", data["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits a growing answer into content and complete tool calls.

    `feed(delta)` and `finish()` return `(content, calls)`: the text now safe to show as
    content, and the calls that closed. Text that may still become a call is held back.
    """

    def __init__(self, fmt: str, forced: bool = False) -> None:
        self.fmt = fmt
        self.forced = forced  # the grammar forces calls: a rest that is no call is a call cut short
        self.buffer = ""  # text not yet handed out
        self.calls: list[ToolCall] = []
        self.num_repeats = 0  # calls dropped because they repeated an earlier one
        self._started = False  # llama3_json: has the answer shown its first non-space character

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        return self._feed_hermes() if self.fmt == HERMES else self._feed_llama3()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: held text becomes content unless it is a complete call (or calls are forced)."""
        content, calls = self.feed("")
        rest, self.buffer = self.buffer, ""
        if self.fmt == LLAMA3_JSON and rest.strip():
            parsed = [_call_from_json(part, len(self.calls) + i) for i, part in enumerate(rest.strip().split(";"))]
            if self.forced:  # the calls before the first one cut short
                parsed = list(itertools.takewhile(lambda call: call is not None, parsed))
            if all(parsed):
                kept = []
                for call in parsed:
                    if not self._repeats(call):
                        call.index = len(self.calls)
                        self.calls.append(call)
                        kept.append(call)
                return content, calls + kept
        if self.forced or (self.calls and not rest.strip()):  # whitespace after the last call is not content
            rest = ""
        return content + rest, calls

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            start = self.buffer.find(_OPEN)
            if start < 0:
                keep = len(self.buffer) - _partial_suffix(self.buffer, _OPEN)
                if self.calls and not self.buffer[:keep].strip():
                    return content, calls  # whitespace after a call: hold it until what follows shows
                content += self.buffer[:keep]
                self.buffer = self.buffer[keep:]
                return content, calls
            if not (self.calls and not self.buffer[:start].strip()):  # whitespace between calls is dropped
                content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(_CLOSE)
            if end < 0:
                return content, calls  # inside a call: hold it until it closes
            block = self.buffer[: end + len(_CLOSE)]
            self.buffer = self.buffer[end + len(_CLOSE) :]
            call = _call_from_json(block[len(_OPEN) : -len(_CLOSE)].strip(), len(self.calls))
            if call is None:
                content += block
            elif not self._repeats(call):
                self.calls.append(call)
                calls.append(call)

    def _repeats(self, call: ToolCall) -> bool:
        """Whether `call` repeats an earlier call of this answer exactly (then it is dropped: the
        same call twice returns the same result twice; small models repeat themselves)."""
        repeats = any((c.name, c.arguments) == (call.name, call.arguments) for c in self.calls)
        self.num_repeats += repeats
        return repeats

    def _feed_llama3(self) -> tuple[str, list[ToolCall]]:
        if not self._started:
            stripped = self.buffer.lstrip()
            if not stripped:
                return "", []
            self._started = True
            if not stripped.startswith("{"):
                self.fmt = "content"
        if self.fmt == "content":
            content, self.buffer = self.buffer, ""
            return content, []
        return "", []  # a JSON call: parsed whole at the end


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# ---- forcing a call -----------------------------------------------------------------------


def _calls_schema(tools: list[dict[str, Any]], fmt: str) -> dict[str, Any]:
    """One call of any of `tools`: an anyOf of {"name": const, "arguments": parameters}, each
    tool's definitions hoisted to the root (its refs would not resolve where it is nested)."""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters, tool_defs = json_schemas.nest(function["parameters"], f"/anyOf/{i}/properties/{key}", f"{i}.")
        defs.update(tool_defs)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": calls}
    if defs:
        schema["$defs"] = defs
    return json_schemas.prepare(schema)


def forced_call_lark(tools: list[dict[str, Any]], fmt: str, only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance dialect) whose sentences are calls of `tools` in format `fmt`.

    `only` names the one tool allowed; `parallel` allows more than one call.
    """
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    if not chosen:
        raise ToolCallError(f"tool_choice names {only!r}, which is not among the tools", "tool_choice")
    schema = _calls_schema(chosen, fmt)
    separator, open_, close = ('";"', "", "") if fmt == LLAMA3_JSON else (r'"\n"', rf'"{_OPEN}\n" ', rf' "\n{_CLOSE}"')
    repeat = f" ({separator} call)*" if parallel else ""
    return f"start: call{repeat}\ncall: {open_}body{close}\nbody: %json {json.dumps(schema)}\n"


class RepeatStop(GrammarProcessor):
    """The forced-call grammar's processor that also ends the answer (only end-of-sequence is
    allowed) once a call closes that repeats an earlier one: the grammar would let a model that
    never stops call the same function until max_tokens."""

    def __init__(
        self, lltokenizer: llg.LLTokenizer, grammar: str, eos_token_ids: list[int], tokenizer: Tokenizer, fmt: str
    ) -> None:
        super().__init__(lltokenizer, grammar, eos_token_ids)
        self.tokenizer = tokenizer
        self.fmt = fmt

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        """logits: (vocab,) -> (vocab,), only end-of-sequence left once a call repeated."""
        logits = super().__call__(output_ids, logits)
        if self.is_accepting and self.eos_token_ids and self._has_repeated(output_ids):
            only_eos = np.zeros(logits.shape[0], dtype=bool)
            only_eos[[i for i in self.eos_token_ids if i < logits.shape[0]]] = True
            logits = mx.where(mx.array(only_eos), logits, -mx.inf)
        return logits

    def _has_repeated(self, output_ids: list[int]) -> bool:
        parser = ToolCallParser(self.fmt, forced=True)
        parser.feed(self.tokenizer.decode(output_ids))
        parser.finish()
        return parser.num_repeats > 0
