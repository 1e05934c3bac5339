"""Reading tool calls out of an answer, whole or as it streams: one `ToolCallParser` per answer.

A parser's `feed(delta)` and `finish()` return `(content, calls)`: the text now safe to show as
content, and the calls that closed. Text that may still become a call is held back, so a stream's
deltas reassemble to exactly the whole answer's result; text parsed into a call is never content.
`make_parser(fmt)` gives the parser for one of the formats `markers.detect_format` names:

- `JsonCallParser` reads the two formats whose calls are JSON objects, the ones calls can be
  forced in (forcing.py):
  - `hermes` (Hermes, Qwen 2/2.5/3 and any template that mentions `<tool_call>`):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
  - `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, several
    calls separated by `;`, also when the answer keeps the `<|python_tag|>` that may open them.
- `RereadingParser` reads every other format, with its reader (formats.py, blocks.py; the list
  is `READERS`): the whole answer is read again on each delta and the difference handed out.

Content outside calls streams as it comes; a call is handed out as soon as it closes. A call that
never closes (the answer ran out of tokens, or its JSON is broken) is no call: its text is content.
"""

from __future__ import annotations

import itertools
import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baselm.toolcalls import formats
from baselm.toolcalls.blocks import BLOCK_FORMATS, block_reader

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
PYTHON_TAG = "<|python_tag|>"  # may open Llama 3's calls
READERS = {**formats.READERS, **{fmt: block_reader(fmt) for fmt in BLOCK_FORMATS}}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"  # around each hermes call
# Every marker of a reread format starts with one of these (checked by the tests).
MARKER_STARTS = frozenset("<[")


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


class ToolCallParser(ABC):
    """Splits one growing answer into content and complete tool calls; `calls` holds every call so far."""

    calls: list[ToolCall]

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(the content now safe to show, the calls that closed) after `delta`."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest, once the answer has ended: what was held back, as content or calls."""


def make_parser(fmt: str, forced: bool = False, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCallParser:
    """A fresh parser for one answer in format `fmt`; `forced`: a grammar forces calls (hermes,
    llama3_json); `tools` types the XML formats' parameters."""
    if fmt in (HERMES, LLAMA3_JSON):
        parser = JsonCallParser(fmt, forced, [t["function"]["name"] for t in tools if "function" in t])
        return _PythonTagParser(parser) if fmt == LLAMA3_JSON else parser
    if fmt in READERS:
        return RereadingParser(fmt, tools)
    raise ValueError(f"no tool-call parser for format {fmt!r}")


class JsonCallParser(ToolCallParser):
    """`hermes` and `llama3_json` calls, read as the answer streams (llama3_json's whole at the end).

    A call that repeats an earlier call exactly is dropped (a small model may call the same thing
    again and again; `forcing.RepeatStop` ends such an answer when calls are forced). When calls are
    forced (tool_choice required or named), the grammar allows nothing but calls, so a rest that is
    no call is a call cut short and is dropped: the answer ends with the calls that closed and the
    engine's finish reason ("length"). Otherwise it may be plain text that only looks like a call,
    and is returned as content.

    An answer in `hermes` that is one bare JSON call, `{"name": ..., "arguments": {...}}` without the
    tags (as Qwen2.5 models often write it), is a call too when it names one of `tool_names` and the
    whole answer parses: such an answer is held back from its first `{` until it ends.
    """

    def __init__(self, fmt: str, forced: bool = False, tool_names: Sequence[str] = ()) -> None:
        self.fmt = fmt
        self.forced = forced  # the grammar forces calls: a rest that is no call is a call cut short
        self.tool_names = frozenset(tool_names)
        self._bare: bool | None = None  # hermes: the answer may be one call without tags (None: not known yet)
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
        if self._bare:
            call = _call_from_json(rest.strip(), len(self.calls))
            if call is not None and call.name in self.tool_names:
                self.calls.append(call)
                return content, calls + [call]
        if self.forced or (self.calls and not rest.strip()):  # whitespace after the last call is not content
            rest = ""
        return content + rest, calls

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        if self._bare is None:
            stripped = self.buffer.lstrip()
            if not stripped:
                return "", []
            self._bare = stripped.startswith("{") and bool(self.tool_names) and not self.forced
        if self._bare:
            if HERMES_OPEN not in self.buffer:
                return "", []  # held until the answer ends (finish) or a tagged call shows it is none
            self._bare = False
        content, calls = "", []
        while True:
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                keep = len(self.buffer) - formats.held_back(self.buffer, [HERMES_OPEN])
                if self.calls and not self.buffer[:keep].strip():
                    return content, calls  # whitespace after a call: hold it until what follows shows
                content += self.buffer[:keep]
                self.buffer = self.buffer[keep:]
                return content, calls
            if not (self.calls and not self.buffer[:start].strip()):  # whitespace between calls is dropped
                content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(HERMES_CLOSE)
            if end < 0:
                return content, calls  # inside a call: hold it until it closes
            block = self.buffer[: end + len(HERMES_CLOSE)]
            self.buffer = self.buffer[end + len(HERMES_CLOSE) :]
            call = _call_from_json(block[len(HERMES_OPEN) : -len(HERMES_CLOSE)].strip(), len(self.calls))
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
    return _tool_call(index, data["name"], arguments)


class RereadingParser(ToolCallParser):
    """Streams what a reader (formats.py, blocks.py) finds: each delta, the whole answer is read again.

    NOTE: correct because a reader's result for a prefix is a prefix of its later results
    (see formats.py). When the last delta all became content and the next one holds no
    character a marker starts with, every reader would add that one whole to the content too,
    so it streams without the answer being read again (plain text stays linear in its length).
    A call that repeats an earlier one exactly is dropped, as JsonCallParser drops it.
    """

    def __init__(self, fmt: str, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.fmt = fmt
        self._read = READERS[fmt]
        self._tools = tools
        self.text = ""
        self.calls: list[ToolCall] = []
        self.num_repeats = 0  # calls dropped because they repeated an earlier one
        self._num_read = 0  # calls the reader has found so far, repeats included
        self._num_sent = 0  # characters of content handed out
        self._in_content = True  # the answer so far ends in content, none of it held back

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self._in_content and delta and not MARKER_STARTS.intersection(delta):
            self._num_sent += len(delta)
            return delta, []
        content, calls = self._step(final=False)
        self._in_content = bool(delta) and content == delta and not calls
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, list[ToolCall]]:
        parsed = self._read(self.text, final, self._tools)
        content = parsed.content[self._num_sent :]
        self._num_sent = max(self._num_sent, len(parsed.content))
        new = []
        for name, args in parsed.calls[self._num_read :]:
            call = _tool_call(len(self.calls), name, args)
            if any((c.name, c.arguments) == (call.name, call.arguments) for c in self.calls):
                self.num_repeats += 1
                continue
            self.calls.append(call)
            new.append(call)
        self._num_read = len(parsed.calls)
        return content, new


class _PythonTagParser(ToolCallParser):
    """Llama 3's JSON calls, also when the answer keeps the `<|python_tag|>` that may open them."""

    def __init__(self, inner: JsonCallParser) -> None:
        self._inner = inner
        self._held = ""  # an end of the text that may be the start of the tag

    @property
    def calls(self) -> list[ToolCall]:
        return self._inner.calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        text = (self._held + delta).replace(PYTHON_TAG, "")
        keep = formats.held_back(text, [PYTHON_TAG])
        self._held = text[len(text) - keep :] if keep else ""
        return self._inner.feed(text[: len(text) - keep])

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._inner.feed(self._held)
        self._held = ""
        more, more_calls = self._inner.finish()
        return content + more, calls + more_calls


def _tool_call(index: int, name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(index, f"call_{secrets.token_hex(12)}", name, json.dumps(arguments, ensure_ascii=False))
