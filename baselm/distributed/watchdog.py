"""A deadline around work that waits on other ranks.

MLX's collectives block in C++ until every rank takes part. A peer that exits or is killed
closes its sockets and MLX raises (see `comm.run_collective`); a peer that stops without
exiting (stopped, swapped out, a stuck machine) would block the others forever. `Watchdog`
arms a deadline around such work and, when it passes, calls `on_expire`, by default a clear
message on stderr and exit status `EXIT_STATUS`: a blocked collective cannot be interrupted
from Python, so ending the process is the only way out that does not hang.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_STATUS = 75  # EX_TEMPFAIL


def exit_process(what: str, seconds: float) -> None:
    """The default expiry: say what hung and end the process."""
    sys.stderr.write(f"base: {what} waited {seconds:.0f} s for another rank; a rank is stuck. Exiting.\n")
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


class Watchdog:
    """`with watchdog.armed("step"):` — `on_expire(what, timeout)` runs if the block lasts longer
    than `timeout` seconds. One block at a time; a daemon thread keeps the time."""

    def __init__(self, timeout: float, on_expire: Callable[[str, float], None] = exit_process):
        if timeout <= 0:
            raise ValueError(f"a watchdog timeout must be positive, not {timeout}")
        self.timeout = timeout
        self.on_expire = on_expire
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._watch, name="dist-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def armed(self, what: str) -> Iterator[None]:
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None
                self._lock.notify()

    def _watch(self) -> None:
        while True:
            with self._lock:
                while self._deadline is None:
                    self._lock.wait()
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                what, self._deadline = self._what, None
            self.on_expire(what, self.timeout)
