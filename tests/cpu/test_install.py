"""`pip install` of this source tree into a fresh venv, as a person installs it: the install builds
the CPU kernels where the installed package loads them, and without a compiler it still installs.
Slow: a venv, the dependencies from PyPI and, with a compiler, a compile (a minute or two)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESCRIBE = "import baselm.cpu as c; print(c.describe())"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only"),
]


def _fresh_venv(tmp_path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    return tmp_path / "venv" / "bin"


def _copy_sources(destination: Path) -> None:
    """The source tree as a checkout has it, less what .gitignore names (builds, venvs, models)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no list of the source files")
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)


def _pip_install_copy(tmp_path: Path, bin_dir: Path, env: dict[str, str] | None = None) -> None:
    source = tmp_path / "source"
    _copy_sources(source)
    done = subprocess.run(
        [str(bin_dir / "pip"), "install", "-q", str(source)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _describe(bin_dir: Path, cwd: Path) -> str:
    # cwd away from the source tree: `python -c` would import baselm from there
    done = subprocess.run([str(bin_dir / "python"), "-c", DESCRIBE], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_pip_install_builds_the_kernels_the_installed_package_loads(tmp_path):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no compiler here: the next test covers this machine")
    bin_dir = _fresh_venv(tmp_path)
    _pip_install_copy(tmp_path, bin_dir)
    assert _describe(bin_dir, tmp_path).startswith("base CPU kernels (")


def test_without_a_compiler_pip_install_succeeds_and_the_package_says_why(tmp_path):
    bin_dir = _fresh_venv(tmp_path)
    (tmp_path / "empty-bin").mkdir()
    env = {key: value for key, value in os.environ.items() if key != "CXX"} | {"PATH": str(tmp_path / "empty-bin")}
    _pip_install_copy(tmp_path, bin_dir, env)
    expected = "MLX reference ops (its build failed: no C++ compiler found (install g++))"
    assert _describe(bin_dir, tmp_path) == expected
