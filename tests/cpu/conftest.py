"""Fixtures for the CPU kernel tests: the module (skipping where it is not built) and each
instruction set this CPU runs, so every compiled path is checked, not only the widest."""

from __future__ import annotations

from collections.abc import Iterator
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
