"""What `base run`, `base chat` and `base serve` say at start when the model will run on the CPU
without the compiled kernels: one line on stderr, with why and how to build them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from baselm import cpu
from baselm.commands.model import warn_without_cpu_kernels
from baselm.distributed.group import PARENT_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")

REASON = "its build failed: no C++ compiler found (install g++)"
WARNING = (
    f"warning: CPU kernels not loaded ({REASON}): decode runs on MLX's own CPU ops, several times slower. "
    f"Build them: {sys.executable} -m baselm.cpu.build"
)
# The real CLI in a process whose kernels did not load (the reason is the first argument).
CLI_WITHOUT_KERNELS = (
    "import sys; from baselm import cpu; cpu.kernels = None; cpu.status['reason'] = sys.argv.pop(1); "
    "from baselm.cli import app; app(sys.argv[1:], prog_name='base')"
)


@pytest.fixture
def kernels_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "kernels", None)
    monkeypatch.setitem(cpu.status, "reason", REASON)
    monkeypatch.delenv(PARENT_ENV, raising=False)


def test_on_the_cpu_it_is_one_line_with_the_reason_and_the_fix(kernels_missing, capsys):
    warn_without_cpu_kernels("cpu")
    assert capsys.readouterr().err == WARNING + "\n"


def test_turned_off_by_base_cpu_kernels_0_it_is_not_said(kernels_missing, monkeypatch, capsys):
    monkeypatch.setitem(cpu.status, "reason", cpu.DISABLED)
    warn_without_cpu_kernels("cpu")
    assert capsys.readouterr().err == ""


def test_on_the_gpu_it_is_not_said(kernels_missing, capsys):
    warn_without_cpu_kernels("gpu")
    assert capsys.readouterr().err == ""


def test_a_rank_another_base_process_started_does_not_say_it_again(kernels_missing, monkeypatch, capsys):
    monkeypatch.setenv(PARENT_ENV, "1")
    warn_without_cpu_kernels("cpu")
    assert capsys.readouterr().err == ""


def test_with_the_kernels_loaded_it_is_not_said(monkeypatch, capsys):
    monkeypatch.setattr(cpu, "kernels", cpu.kernels or object())
    warn_without_cpu_kernels("cpu")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", [["run", "hi"], ["chat"], ["serve"]], ids=lambda c: c[0])
def test_each_command_says_it_once_before_anything_else(command, tmp_path):
    name, *rest = command
    argv = [name, str(tmp_path / "nope.gguf"), *rest, "--device", "cpu"]
    env = {key: value for key, value in os.environ.items() if key != PARENT_ENV} | {"BASE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_KERNELS, REASON, *argv],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    lines = done.stderr.splitlines()
    assert lines[0] == WARNING
    assert [line for line in lines if "CPU kernels" in line] == [WARNING]
    assert lines[1].startswith("error: ") and done.returncode == 1
