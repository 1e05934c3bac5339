"""The answer on the screen as it streams: live markdown in a terminal, plain text otherwise."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.text import Text


class _LiveAnswer:
    """What the terminal shows while an answer streams: the last screenful of its markdown and a footer."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = max(console.height - 3, 1)
        lines = console.render_lines(Markdown(self.text), options.update(height=None), pad=False)
        for line in lines[-room:]:
            yield from line
            yield Segment.line()
        yield Text(f"{self.num_tokens} tokens · Ctrl-C stops", style="dim")


class AnswerView:
    """Shows an answer as it streams: markdown in a terminal, plain text otherwise."""

    def __init__(self, console: Console, rich_output: bool) -> None:
        self.console = console
        self.rich_output = rich_output
        self._live: Live | None = None
        self._answer = _LiveAnswer()

    def __enter__(self) -> AnswerView:
        if self.rich_output:
            self._live = Live(self._answer, console=self.console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def add(self, text: str, num_tokens: int) -> None:
        self._answer.text += text
        self._answer.num_tokens += num_tokens
        if not self.rich_output and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return
        self._live.__exit__(None, None, None)
        if self._answer.text.strip():
            self.console.print(Markdown(self._answer.text))
