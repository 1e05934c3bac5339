"""Progress of the store's long steps (downloads, conversions): bars on a terminal, lines otherwise.

One protocol for every step and every reporter: `start(label, total, done)`, `advance(n)`,
`finish()`. `base pull` reports to stderr (never stdout, which `--json` outputs and scripts
read); the server's `/api/pull` passes its own reporter with the same three methods. A step
is of a kind (`STEPS`: a download or a signature check counts bytes, a conversion tensors, a
build percent), and its end prints one closing line:
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

# Each kind of step: what it is called while it runs and once done, and what it counts.
STEPS = {
    "download": ("downloading", "downloaded", "bytes"),
    "convert": ("converting", "converted", "tensors"),
    "check": ("checking", "checked", "bytes"),
    "build": ("building", "built", "%"),
}


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

    def __init__(self, kind: str) -> None:
        self.doing, self.did, self.unit = STEPS[kind]
        self.label, self.total, self.done, self.started = "", 0, 0, 0.0

    def begin(self, label: str, total: int, done: int) -> None:
        self.label, self.total, self.done, self.started = label, total, done, time.perf_counter()

    def summary(self) -> str:
        seconds = time.perf_counter() - self.started
        if self.unit == "%":  # a build: how much is not worth saying once it is whole
            return f"{self.did} {self.label} in {seconds:.1f} s"
        return f"{self.did} {self.label}: {amount(self.done, self.unit)} in {seconds:.1f} s"


class LineProgress:
    """Plain lines (for logs and pipes): the start, each further 25%, and a closing line."""

    def __init__(self, stream: Any = None, kind: str = "download") -> None:
        self.stream = stream or sys.stderr
        self.step, self.next_mark = _Step(kind), 0

    def start(self, label: str, total: int, done: int) -> None:
        self.step.begin(label, total, done)
        unit = self.step.unit
        resumed = f", resuming at {amount(done, unit)}" if done else ""
        print(f"{self.step.doing} {label} ({amount(total, unit)}{resumed})", file=self.stream, flush=True)
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

    def __init__(self, kind: str = "download") -> None:
        self.step, self.task = _Step(kind), None
        unit = self.step.unit
        extra = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else (MofNCompleteColumn(),)
        self.console = Console(stderr=True)
        columns = (*Bars.get_default_columns(), *(extra if unit != "%" else ()))
        self.bars = Bars(*columns, console=self.console, transient=True)  # the bar gives way to the closing line

    def start(self, label: str, total: int, done: int) -> None:
        self.step.begin(label, total, done)
        self.bars.start()
        self.task = self.bars.add_task(label, total=total or None, completed=done)

    def advance(self, num_bytes: int) -> None:
        self.step.done += num_bytes
        self.bars.update(self.task, advance=num_bytes)

    def finish(self) -> None:
        self.bars.stop()
        self.bars.remove_task(self.task)
        self.console.print(self.step.summary(), highlight=False)


def default_progress(quiet: bool = False, kind: str = "download") -> Progress:
    """Bars on a terminal, plain lines otherwise, nothing when quiet; `kind`: one of `STEPS`."""
    if quiet:
        return NoProgress()
    return RichProgress(kind) if sys.stderr.isatty() else LineProgress(kind=kind)
