"""Fixtures for the CPU kernel tests: the module (skipping where it is not built) and each
instruction set this CPU runs, so every compiled path is checked, not only the widest."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from baselm import cpu

requires_kernels = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels not loaded: {cpu.status['reason']}")


def _isas() -> list[str]:
    return cpu.kernels.supported_isas() if cpu.available() else ["none"]


@pytest.fixture(params=_isas())
def kernels(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The kernels module running with one instruction set (restored afterwards)."""
    if not cpu.available():
        pytest.skip(f"CPU kernels not loaded: {cpu.status['reason']}")
    before = cpu.kernels.isa()
    cpu.kernels.set_isa(request.param)
    yield cpu.kernels
    cpu.kernels.set_isa(before)


def off_the_main_thread(call: Callable[[], object]) -> object:
    """call() on a thread of its own, its arrays on that thread's stream; what it raised is raised here.

    For evaluations meant to fail: MLX (0.32) raises a stream's error on the main thread when the next
    task is queued there, after it has counted that task as running, so a failed evaluation on the main
    thread can leave the count one too high for good; past 10, any later evaluation with nothing else
    running waits forever (a whole suite's run hung so). Off the main thread nothing is counted twice.
    The arrays `call` takes from this thread must have been evaluated here: a thread cannot run another
    thread's stream."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread as it was
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
