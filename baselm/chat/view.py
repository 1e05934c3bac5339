"""The answer on the screen as it streams: live markdown in a terminal, plain text otherwise.

A reasoning model's thinking (`<think>...</think>`, split off by baselm/reasoning.py) is shown
dimmed above the answer in a terminal; through a pipe it goes to stderr, so stdout holds only
answers.
"""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.text import Text

from baselm.reasoning import ReasoningSplitter

THINKING_STYLE = "dim italic"


class _LiveAnswer:
    """What the terminal shows while an answer streams: the last screenful of its thinking and
    markdown, and a footer."""

    def __init__(self) -> None:
        self.thinking = ""
        self.text = ""
        self.num_tokens = 0

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = max(console.height - 3, 1)
        lines = []
        if self.thinking:
            lines += console.render_lines(Text(self.thinking.strip("\n"), style=THINKING_STYLE), options, pad=False)
        lines += console.render_lines(Markdown(self.text), options.update(height=None), pad=False)
        for line in lines[-room:]:
            yield from line
            yield Segment.line()
        yield Text(f"{self.num_tokens} tokens · Ctrl-C stops", style="dim")


class AnswerView:
    """Shows an answer as it streams: markdown in a terminal, plain text otherwise. With a
    `splitter`, the model's thinking is shown apart from its answer."""

    def __init__(self, console: Console, rich_output: bool, splitter: ReasoningSplitter | None = None) -> None:
        self.console = console
        self.rich_output = rich_output
        self.splitter = splitter
        self._live: Live | None = None
        self._answer = _LiveAnswer()

    def __enter__(self) -> AnswerView:
        if self.rich_output:
            self._live = Live(self._answer, console=self.console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def add(self, text: str, num_tokens: int) -> None:
        thinking, answer = self.splitter.feed(text) if self.splitter else ("", text)
        self._show(thinking, answer, num_tokens)

    def _show(self, thinking: str, answer: str, num_tokens: int) -> None:
        self._answer.thinking += thinking
        self._answer.text += answer
        self._answer.num_tokens += num_tokens
        if not self.rich_output:
            for stream, text in ((sys.stderr, thinking), (sys.stdout, answer)):
                if text:
                    stream.write(text)
                    stream.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.splitter:
            self._show(*self.splitter.finish(), 0)
        if self._live is None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return
        self._live.__exit__(None, None, None)
        if self._answer.thinking.strip():
            self.console.print(Text(self._answer.thinking.strip("\n"), style=THINKING_STYLE))
        if self._answer.text.strip():
            self.console.print(Markdown(self._answer.text))
