"""Input for the REPL: lines with readline and a history file, and multi-line messages joined from them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from baselm.store.default_model import base_home

HISTORY_FILE = "chat_history"


def last_chat_path() -> Path:
    """Where the conversation is kept after each turn, for `base chat --resume`."""
    return base_home() / "chat_last.json"


def history_path() -> Path:
    """Where the input history lives: $BASE_HOME/chat_history."""
    return base_home() / HISTORY_FILE


def join_continued(first: str, read_more: Callable[[], str]) -> str:
    """One message from input lines: a trailing backslash continues a line; \"\"\" opens a block
    that runs to the line ending in \"\"\"."""
    if first.strip().startswith('"""'):
        body = first.strip()[3:]
        if body.endswith('"""'):
            return body[:-3]
        lines = [body] if body else []
        while True:
            line = read_more()
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)
    lines = []
    line = first
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_more()
    lines.append(line)
    return "\n".join(lines)


class LineReader:
    """Reads lines with readline (arrow keys, history kept under BASE_HOME) when it is available."""

    def __init__(self, history_path: Path | None, interactive: bool) -> None:
        self.interactive = interactive
        self.history_path = history_path
        self._readline = None
        if interactive and history_path is not None:
            self._readline = _setup_readline(history_path)

    def read(self, prompt: str) -> str:
        """One line; raises EOFError at end of input and KeyboardInterrupt on Ctrl-C."""
        return input(prompt if self.interactive else "")

    def remember(self) -> None:
        if self._readline is None:
            return
        with contextlib.suppress(OSError):
            self._readline.write_history_file(str(self.history_path))


def _setup_readline(path: Path) -> ModuleType | None:
    # Imported only for an interactive chat: importing readline hooks it into input() and may
    # write terminal codes, which piped output must not get; it is also missing on some platforms.
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return None
    readline.set_history_length(2000)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            readline.read_history_file(str(path))
    return readline
