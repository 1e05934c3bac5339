"""What the kernels build does where it cannot compile, and what the package says about a build that
is missing: none of these compile anything."""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from baselm.cpu import build, paths

NO_COMPILER = "no C++ compiler found (install g++)"
WARNING = f"warning: CPU kernels not built ({NO_COMPILER}); base runs on MLX's own CPU ops"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


@pytest.fixture
def package_dir(tmp_path: Path) -> Path:
    """A baselm/cpu folder as a wheel's build holds it: one kernel source, nothing built."""
    (tmp_path / "cpu" / "csrc").mkdir(parents=True)
    (tmp_path / "cpu" / "csrc" / "module.cpp").write_text("// a kernel source\n")
    return tmp_path / "cpu"


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A machine with neither g++ nor c++ on PATH."""
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("CXX", raising=False)


def _write_module(package_dir: Path, key: str) -> None:
    folder = paths.build_root(package_dir) / key
    folder.mkdir(parents=True)
    (folder / f"{paths.MODULE_NAME}{EXT_SUFFIX}").write_bytes(b"")


def test_without_a_compiler_the_build_warns_and_exits_0(package_dir, no_compiler, capsys):
    assert build.main(["--package-dir", str(package_dir)]) == 0
    assert capsys.readouterr().err == WARNING + "\n"
    assert not paths.module_path(package_dir).exists()


def test_without_a_compiler_check_exits_1(package_dir, no_compiler):
    assert build.main(["--package-dir", str(package_dir), "--check"]) == 1


def test_a_failed_build_leaves_its_reason_for_the_package_to_quote(package_dir, no_compiler):
    build.main(["--package-dir", str(package_dir)])
    error = paths.module_path(package_dir).with_name(paths.BUILD_ERROR)
    assert error.read_text() == f"{NO_COMPILER}\n"
    assert paths.missing_reason(package_dir) == f"its build failed: {NO_COMPILER}"


def test_the_key_follows_the_kernel_sources(package_dir):
    before = paths.build_key(package_dir)
    (package_dir / "csrc" / "module.cpp").write_text("// an edited kernel source\n")
    assert paths.build_key(package_dir) != before
    assert before.startswith(f"mlx-{metadata.version('mlx')}-")


def test_nothing_built_says_so(package_dir):
    assert paths.missing_reason(package_dir) == "not built for this mlx and these sources"


def test_a_build_for_another_mlx_names_both_versions(package_dir):
    """What an isolated `pip install` into an environment that keeps an older mlx leaves."""
    _write_module(package_dir, "mlx-0.31.0-0123456789abcdef")
    installed = metadata.version("mlx")
    assert paths.missing_reason(package_dir) == f"built for mlx 0.31.0, not the installed {installed}"


def test_a_build_for_other_sources_of_this_mlx_says_so(package_dir):
    _write_module(package_dir, f"mlx-{metadata.version('mlx')}-0123456789abcdef")
    assert paths.missing_reason(package_dir) == "built for other kernel sources, nanobind or Python than these"


def test_an_existing_build_is_returned_without_compiling(package_dir, no_compiler):
    """A second install (or `make install` after `pip install -e .`) finds this key's module."""
    _write_module(package_dir, paths.build_key(package_dir))
    assert build.build(package_dir=package_dir) == paths.module_path(package_dir)


class Recorder:
    """A progress reporter that keeps what it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple] = []

    def start(self, label: str, total: int, done: int) -> None:
        self.heard.append(("start", label, total, done))

    def advance(self, num: int) -> None:
        self.heard.append(("advance", num))

    def finish(self) -> None:
        self.heard.append(("finish",))


def test_the_compile_reports_cmakes_percent_marks_and_logs_every_line(tmp_path):
    from baselm.cpu.build import _run

    lines = "[ 25%] Building CXX object a.o\nnote: a warning\n[ 25%] Building CXX object b.o\n[100%] Linking\n"
    recorder, log = Recorder(), tmp_path / "build.log"
    _run([sys.executable, "-c", f"print({lines!r}, end='')"], log, "the compile", recorder)
    assert recorder.heard == [("advance", 25), ("advance", 75)]
    assert log.read_text() == lines
