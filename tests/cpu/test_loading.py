"""How baselm.cpu finds its compiled module, and what it says when it does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from baselm import cpu


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = "from baselm import cpu; print(cpu.available(), cpu.describe())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_kernels_are_built_where_a_compiler_exists() -> None:
    """Installing the package builds them wherever g++ is installed; a silent skip would hide a broken build."""
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("no compiler here: the reference path is expected")
    if os.environ.get("BASE_CPU_KERNELS") == "0":
        pytest.skip("kernels turned off by BASE_CPU_KERNELS=0")
    assert cpu.available(), cpu.status["reason"]


def test_base_cpu_kernels_0_turns_them_off() -> None:
    out = _status_in_subprocess({"BASE_CPU_KERNELS": "0"})
    assert out == "False MLX reference ops (disabled by BASE_CPU_KERNELS=0)"


def test_describe_names_the_path() -> None:
    if cpu.available():
        assert cpu.describe().startswith(f"base CPU kernels ({cpu.kernels.isa()}, ")
    else:
        assert cpu.describe() == f"MLX reference ops ({cpu.status['reason']})"
