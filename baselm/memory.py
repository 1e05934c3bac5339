"""Handing freed memory back to the OS while a model loads, and when a server falls idle; a server's
malloc arenas capped and its mmap threshold fixed.

Loading frees as much as it keeps: unfused and unpermuted tensors, a file's converted copies,
a vocabulary's strings. MLX keeps freed buffers in a cache of its own, and glibc keeps freed
heap pages in the process (a new, larger fused tensor rarely fits the holes the parts it was
made of leave), so without this a load peaks well above what it ends with. A server's bursts do
the same (a batch's activations, a large request body parsed and rendered): `IdleRelease` gives
that back once the engine has been idle a moment.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import mlx.core as mx


def _glibc_call(name: str, *args: int) -> bool:
    """libc's `name`(*args) returned 1; False off Linux or off glibc (no such function)."""
    if sys.platform.startswith("linux"):
        try:
            return getattr(ctypes.CDLL(None), name)(*args) == 1
        except (OSError, AttributeError):  # not glibc
            pass
    return False


def release_freed_memory() -> None:
    """Empties MLX's cache of freed buffers and, on glibc, returns the heap's free pages."""
    mx.clear_cache()
    _glibc_call("malloc_trim", 0)


M_ARENA_MAX = -8  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
SERVER_ARENAS = 2
SERVER_MMAP_THRESHOLD = 256 * 1024


def tune_malloc_for_serving(arenas: int = SERVER_ARENAS, mmap_threshold: int = SERVER_MMAP_THRESHOLD) -> bool:
    """Caps glibc's malloc arenas for the threads made from now on (a server's request threads), and
    fixes the size from which an allocation gets pages of its own (mmap) instead of heap space.

    By default each thread that meets a busy arena gets one of its own, up to 8 per core, and what a
    burst of requests leaves scattered in a new arena stays resident: under the abuse of many slow
    and vanishing clients on a loaded 2-core machine, RSS grew 50 MiB, 22 MiB of it in two new arenas,
    and stayed there after the idle release; with 2 arenas it grew 7 MiB. And glibc raises that size
    to the largest block freed so far (up to 32 MiB), after which a burst's buffers of a few MiB are
    carved from an arena and pin its pages between the small objects that outlive them: after the same
    abuse an arena held 9-27 MiB more than before it, trimmed or not; with the size fixed at 256 KiB
    such buffers go back to the system when freed. False off glibc."""
    return _glibc_call("mallopt", M_ARENA_MAX, arenas) and _glibc_call("mallopt", M_MMAP_THRESHOLD, mmap_threshold)


class _Work:
    """When something last allocated and freed a lot, and when that was last given back."""

    lock = threading.Lock()
    last_work = 0.0
    last_release = 0.0


def note_work() -> None:
    """Tells the idle release that something allocated and freed a lot (a large request body read,
    parsed, rendered and dropped); any thread."""
    with _Work.lock:
        _Work.last_work = time.monotonic()


class IdleRelease:
    """Calls `release_freed_memory` on an engine's thread (MLX's cache is freed from the thread that
    runs it) once the engine has been idle, and nothing has been noted, for `after_s`, when something
    ran since the last release: a step of this engine, or `note_work` anywhere in the process."""

    def __init__(self, after_s: float = 1.0) -> None:
        self.after_s = after_s
        self._idle_since: float | None = None

    def busy(self) -> None:
        """The engine ran a step or a slice."""
        note_work()
        self._idle_since = None

    def idle(self) -> bool:
        """The engine found nothing to do; True when this call released memory."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        with _Work.lock:
            quiet_since = max(self._idle_since, _Work.last_work)
            if _Work.last_work <= _Work.last_release or now - quiet_since < self.after_s:
                return False
            _Work.last_release = now
        release_freed_memory()
        return True
