"""A request's own text stays plain text inside a chat prompt, whatever control tokens it spells.

A chat template writes its markers (`<|im_start|>`, `<|im_end|>`, ...) as text, and the rendered
prompt is encoded with special tokens matched. So a message whose content spells a marker would
be encoded as that control token: a user could end their turn and open a system one. Here the
request's strings (messages, tools, the template variables it sets) are marked before rendering
(`ControlText.mark`: `MARK` after the first character of every special token they spell, so no
token matches there), and after rendering the marks are taken out and the stretches they marked
recorded (`ControlText.unmark` -> `RenderedChat.plain_spans`). `Tokenizer.encode_rendered` then
encodes those stretches as ordinary text, while every marker the template wrote stays a control
token. A prompt in which the request spells no special token encodes exactly as before.

Only special (control) tokens are kept out; plain added tokens (`<think>`, `<tool_call>` in many
vocabularies) are matched in any text, as llama.cpp and transformers match them. A raw prompt
(completions, Ollama's `raw` generate, embeddings' input) is the caller's whole prompt and is not
marked: special tokens in it are parsed (`Tokenizer.encode`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MARK = "\ufdd0"  # a noncharacter: Unicode keeps it for a program's internal use


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat prompt's text, and where in it the request's own text spells special tokens."""

    text: str
    plain_spans: tuple[tuple[int, int], ...] = ()  # (start, end) character offsets, ascending


class ControlText:
    """Marks and unmarks the special tokens of one vocabulary in a request's strings."""

    def __init__(self, special_tokens: Iterable[str]) -> None:
        self.special_tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)  # longest first
        self._pattern = re.compile("|".join(re.escape(t) for t in [*self.special_tokens, MARK]))

    def mark(self, value: Any) -> Any:
        """A copy of `value` (messages, tools, variables: dicts, lists, strings) with every special
        token its strings spell marked, and every MARK they hold doubled; other values as they are."""
        if isinstance(value, str):
            return self._pattern.sub(_mark, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        if hasattr(value, "model_dump"):
            return self.mark(value.model_dump())
        return value

    def unmark(self, text: str) -> RenderedChat:
        """The rendered `text` without its marks, and the spans of the special tokens they marked.

        NOTE: a mark no special token follows (a template cut the string after it) is dropped.
        """
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        size, i = 0, 0  # characters in `out`; the position in `text`
        while True:
            at = text.find(MARK, i)
            if at < 0:
                out.append(text[i:])
                return RenderedChat("".join(out), tuple(spans))
            out.append(text[i:at])
            size += at - i
            if text.startswith(MARK, at + 1):  # a MARK of the request's own
                out.append(MARK)
                size, i = size + 1, at + 2
                continue
            token = self._marked_token(text, at)
            if token is not None:
                out.append(token[1:])
                spans.append((size - 1, size - 1 + len(token)))
                size, i = size + len(token) - 1, at + len(token)
            else:
                i = at + 1

    def _marked_token(self, text: str, at: int) -> str | None:
        """The special token whose first character is just before the mark at `at`."""
        if at == 0:
            return None
        for token in self.special_tokens:
            if text[at - 1] == token[0] and text.startswith(token[1:], at + 1):
                return token
        return None


def _mark(match: re.Match) -> str:
    found = match.group()
    return MARK + MARK if found == MARK else found[0] + MARK + found[1:]
