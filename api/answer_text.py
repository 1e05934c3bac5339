"""One answer's text as every protocol shows it: thinking, content and tool calls, apart.

The engine hands out plain text. A reasoning model's thinking is split off first
(baselm/reasoning.py), then the rest is read for tool calls (baselm/toolcalls), so a call written
while thinking is never run. Chat completions, Responses, Messages and Ollama all read their
answers through `AnswerText`, one per choice, streamed or whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baselm.api.state import ModelState
from baselm.harmony import HarmonySplitter
from baselm.reasoning import ReasoningSplitter, prompt_opens_thinking
from baselm.toolcalls import parsers
from baselm.toolcalls.markers import HARMONY

# Enough prompt tokens to see the template's last `<think>` or `</think>` and what follows it.
_PROMPT_TAIL_TOKENS = 32


@dataclass(slots=True)
class Pieces:
    """What one piece of an answer adds: thinking, content, and the tool calls that closed."""

    reasoning: str = ""
    content: str = ""
    calls: list[parsers.ToolCall] = field(default_factory=list)


class AnswerText:
    """Splits one choice's growing text into `Pieces`; `feed` the engine's text, `finished` on its last output."""

    def __init__(
        self,
        splitter: ReasoningSplitter | HarmonySplitter | None,
        tool_format: str | None,
        tool_list: Sequence[Mapping[str, Any]] = (),
        forced: bool = False,
    ) -> None:
        self.splitter = splitter
        self.parser = parsers.make_parser(tool_format, forced, tool_list) if tool_format else None
        # A harmony answer's messages are read for their content even when no tools were given.
        self._calls_wanted = self.parser is not None
        if self.parser is None and isinstance(splitter, HarmonySplitter):
            self.parser = parsers.make_parser(HARMONY)

    @classmethod
    def for_prompt(
        cls,
        state: ModelState,
        prompt_ids: list[int],
        tool_format: str | None,
        tool_list: Sequence[Mapping[str, Any]] = (),
        forced: bool = False,
    ) -> AnswerText:
        """An AnswerText for an answer to `prompt_ids`: thinking is split off when the model thinks; calls are
        read in `tool_format` (`tool_list` types some formats' arguments; `forced` when a grammar forces them)."""
        return cls(thinking_splitter(state, prompt_ids), tool_format, tool_list, forced)

    @property
    def num_calls(self) -> int:
        return len(self.parser.calls) if self.parser and self._calls_wanted else 0

    def feed(self, text: str, finished: bool) -> Pieces:
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        if finished and self.splitter:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.parser is None:
            return Pieces(reasoning, content)
        content, calls = self.parser.feed(content)
        if finished:
            more, more_calls = self.parser.finish()
            content, calls = content + more, calls + more_calls
        return Pieces(reasoning, content, calls if self._calls_wanted else [])


def thinking_splitter(state: ModelState, prompt_ids: list[int]) -> ReasoningSplitter | HarmonySplitter | None:
    """A splitter for an answer to `prompt_ids` when the model thinks (gpt-oss in harmony's
    analysis channel), else None."""
    if state.tool_format == HARMONY:
        return HarmonySplitter()
    if not state.thinks:
        return None
    tail = state.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:])
    return ReasoningSplitter(in_thinking=prompt_opens_thinking(tail))
