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


# glibc's malloc_info, written to a file: one <heap> per arena, and a total of the chunks mmapped
MALLOC_INFO = r"""
import ctypes, re, sys, threading
from baselm.memory import tune_malloc_for_serving

libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

def malloc_info(path):
    out = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, out)
    libc.fclose(out)
    with open(path) as f:
        return f.read()
"""

ARENAS_SCRIPT = (
    MALLOC_INFO
    + r"""
assert tune_malloc_for_serving(2)
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
malloc_info(sys.argv[1])
"""
)


def test_a_server_caps_its_malloc_arenas(tmp_path) -> None:
    """16 threads allocating at once get at most the 2 arenas `base serve` allows (glibc's malloc_info
    lists one <heap> per arena); each would otherwise take one of its own when it met a busy one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc arenas: Linux only")
    info = tmp_path / "malloc_info.xml"
    subprocess.run([sys.executable, "-c", ARENAS_SCRIPT, str(info)], check=True, timeout=120)
    assert 1 <= info.read_text().count("<heap nr=") <= 2


MMAP_SCRIPT = (
    MALLOC_INFO
    + r"""
if sys.argv[2] == "tuned":
    assert tune_malloc_for_serving()

def mmapped():
    return int(re.search(r'<total type="mmap" count="(\d+)"', malloc_info(sys.argv[1])).group(1))

big = bytearray(16 * 2**20)  # a 16 MiB buffer, mmapped and freed: glibc's threshold rises to it
del big
before = mmapped()
kept = [bytearray(2**20) for _ in range(8)]  # 8 buffers of 1 MiB, alive
print(mmapped() - before)
"""
)


@pytest.mark.parametrize(("mode", "mapped"), [("default", 0), ("tuned", 8)])
def test_a_servers_buffers_of_a_mib_get_pages_of_their_own(tmp_path, mode: str, mapped: int) -> None:
    """Once a 16 MiB buffer has been freed, glibc carves later 1 MiB buffers out of its heap, where the
    small objects beside them keep their pages resident after they are freed; `base serve` fixes the
    threshold at 256 KiB, so they are mmapped (malloc_info's count of mmapped chunks) and go back
    when freed."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc: Linux only")
    command = [sys.executable, "-c", MMAP_SCRIPT, str(tmp_path / "malloc_info.xml"), mode]
    done = subprocess.run(command, check=True, timeout=120, capture_output=True, text=True)
    assert int(done.stdout) == mapped
