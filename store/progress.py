"""Progress of the store's long steps (downloads, conversions): bars on a terminal, lines otherwise.

One protocol for every step and every reporter: `start(label, total, done)`, `advance(n)`,
`finish()`. `base pull` reports to stderr (never stdout, which `--json` outputs and scripts
read); the server's `/api/pull` passes its own reporter with the same three methods. A step
counts `bytes` (downloads) or `tensors` (conversions), and its end prints one closing line:
what was done, how much, and how long it took.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from rich.console import Console
from rich.progress import DownloadColumn, MofNCompleteColumn, TransferSpeedColumn
from rich.progress import Progress as Bars

from baselm.store.fs import human_size

VERBS = {"bytes": ("downloading", "downloaded"), "tensors": ("converting", "converted"), "%": ("building", "built")}


class Progress(Protocol):
    """What a long step reports to: its start, each piece done, its end."""

    def start(self, label: str, total: int, done: int) -> None: ...
    def advance(self, num_bytes: int) -> None: ...
    def finish(self) -> None: ...


class NoProgress:
    """Reports nothing (`--quiet`)."""

    def start(self, label: str, total: int, done: int) -> None:
        pass

    def advance(self, num_bytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


def amount(num: int, unit: str) -> str:
    """`98.4 MiB` for bytes, `272 tensors` for tensors."""
    if unit == "%":
        return f"{num}%"
    return human_size(num) if unit == "bytes" else f"{num} {unit}"


class _Step:
    """The label, counts and clock of the step being reported, and its closing line."""

    def __init__(self, unit: str) -> None:
        self.unit, self.label, self.total, self.done, self.started = unit, "", 0, 0, 0.0

    def begin(self, label: str, total: int, done: int) -> None:
        self.label, self.total, self.done, self.started = label, total, done, time.perf_counter()

    def summary(self) -> str:
        seconds = time.perf_counter() - self.started
        if self.unit == "%":  # a build: how much is not worth saying once it is whole
            return f"{VERBS[self.unit][1]} {self.label} in {seconds:.1f} s"
        return f"{VERBS[self.unit][1]} {self.label}: {amount(self.done, self.unit)} in {seconds:.1f} s"


class LineProgress:
    """Plain lines (for logs and pipes): the start, each further 25%, and a closing line."""

    def __init__(self, stream: Any = None, unit: str = "bytes") -> None:
        self.stream = stream or sys.stderr
        self.step, self.next_mark = _Step(unit), 0

    def start(self, label: str, total: int, done: int) -> None:
        self.step.begin(label, total, done)
        unit = self.step.unit
        resumed = f", resuming at {amount(done, unit)}" if done else ""
        print(f"{VERBS[unit][0]} {label} ({amount(total, unit)}{resumed})", file=self.stream, flush=True)
        self.next_mark = (done * 4 // max(total, 1) + 1) * total // 4

    def advance(self, num_bytes: int) -> None:
        step = self.step
        step.done += num_bytes
        if step.total and step.done >= self.next_mark and step.done < step.total:
            print(f"  {step.label}: {100 * step.done // step.total}%", file=self.stream, flush=True)
            self.next_mark = (step.done * 4 // step.total + 1) * step.total // 4

    def finish(self) -> None:
        print(f"  {self.step.summary()}", file=self.stream, flush=True)


class RichProgress:
    """One rich progress bar per step, on a terminal (stderr), then its closing line."""

    def __init__(self, unit: str = "bytes") -> None:
        extra = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else (MofNCompleteColumn(),)
        self.console = Console(stderr=True)
        self.bars = Bars(*Bars.get_default_columns(), *extra, console=self.console, transient=True)
        self.step, self.task = _Step(unit), None

    def start(self, label: str, total: int, done: int) -> None:
        self.step.begin(label, total, done)
        self.bars.start()
        self.task = self.bars.add_task(label, total=total or None, completed=done)

    def advance(self, num_bytes: int) -> None:
        self.step.done += num_bytes
        self.bars.update(self.task, advance=num_bytes)

    def finish(self) -> None:
        self.bars.stop()  # transient: the bar gives way to the closing line
        self.bars.remove_task(self.task)
        self.console.print(self.step.summary(), highlight=False)


def default_progress(quiet: bool = False, unit: str = "bytes") -> Progress:
    """Bars on a terminal, plain lines otherwise, nothing when quiet; `unit`: bytes or tensors."""
    if quiet:
        return NoProgress()
    return RichProgress(unit) if sys.stderr.isatty() else LineProgress(unit=unit)
