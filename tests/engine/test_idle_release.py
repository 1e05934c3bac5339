"""IdleRelease (baselm/memory.py): what a burst freed goes back to the OS once the engine is idle."""

from __future__ import annotations

import time

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
