"""The console a command prints its tables on."""

from __future__ import annotations

from rich.console import Console


def table_console() -> Console:
    """A console as wide as the terminal (rich reads its size); into a pipe, as wide as a table
    needs, so nothing is cut or wrapped (rich would assume 80 columns there)."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)
