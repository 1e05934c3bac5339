"""IdleRelease (baselm/memory.py): what a burst freed goes back to the OS once the engine is idle; a
server's malloc arenas capped."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from baselm.memory import IdleRelease, note_work


def test_memory_is_released_once_per_quiet_idle_spell_after_work() -> None:
    release = IdleRelease(after_s=0.01)
    release.busy()
    assert not release.idle()  # idle from this very call: quiet for 0 s, whatever the machine's pace
    time.sleep(0.02)
    assert release.idle()  # quiet long enough since the step
    time.sleep(0.02)
    assert not release.idle()  # nothing ran since: nothing to give back
    note_work()  # a large request body, read on another thread
    time.sleep(0.02)
    assert release.idle()


def test_nothing_is_released_while_work_is_recent() -> None:
    release = IdleRelease(after_s=60.0)
    release.busy()
    assert not release.idle()
    note_work()
    assert not release.idle()


ARENAS_SCRIPT = r"""
import ctypes, sys, threading
from baselm.memory import limit_malloc_arenas

assert limit_malloc_arenas(2)
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
start = threading.Barrier(16)

def churn():
    start.wait()
    for _ in range(2000):
        kept = [bytearray(4096) for _ in range(8)]  # malloc'd, each thread at once
        del kept

threads = [threading.Thread(target=churn) for _ in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join()
out = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, out)
libc.fclose(out)
"""


def test_a_server_caps_its_malloc_arenas(tmp_path) -> None:
    """16 threads allocating at once get at most the 2 arenas `base serve` allows (glibc's malloc_info
    lists one <heap> per arena); each would otherwise take one of its own when it met a busy one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc arenas: Linux only")
    info = tmp_path / "malloc_info.xml"
    subprocess.run([sys.executable, "-c", ARENAS_SCRIPT, str(info)], check=True, timeout=120)
    assert 1 <= info.read_text().count("<heap nr=") <= 2
