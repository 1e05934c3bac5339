"""Builds the CPU kernels module (`python -m baselm.cpu.build`; installing the package runs it).

The module links MLX's C++ library and shares nanobind's type registry with `mlx.core`, so it
only works with the exact mlx wheel it was compiled against. It is built once, at install time
(setup.py runs this for the wheel's copy of the package, or for the source tree of an editable
install; `make install` runs it again against the venv's own mlx), into
`baselm/cpu/_build/<key>/`, the key hashing the mlx version, the Python ABI, the nanobind version
and every kernel source: an upgraded mlx or an edited kernel gets a fresh build and a stale one is
never loaded. A failed build leaves its error there instead (`paths.BUILD_ERROR`), which
`baselm.cpu.status["reason"]` quotes. It is not built lazily at first use: a compile takes a
minute and needs a compiler, which a `base run` should neither wait for nor require (without the
module base runs on MLX's own ops and says so at start).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from baselm.cpu.paths import BUILD_ERROR, MODULE_NAME, PACKAGE_DIR, build_root, module_path

_PERCENT = re.compile(rb"\[\s*(\d+)%\]")  # cmake's build marks its progress so: "[ 50%] Building CXX object"


class _Silent:
    """No progress: where baselm.store or rich cannot be imported (setup.py runs this from the
    source tree, in pip's isolated build environment)."""

    def start(self, label: str, total: int, done: int) -> None:
        pass

    def advance(self, num: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _progress() -> Any:
    """A bar for the compile on a terminal, lines otherwise (see `_Silent`)."""
    try:
        from baselm.store.progress import default_progress
    except ImportError:
        return _Silent()
    return default_progress(kind="build")


class BuildError(RuntimeError):
    """The kernels could not be compiled here: the message says why in a line, `log` is the end
    of the build's output (empty when it did not get that far)."""

    def __init__(self, reason: str, log: str = "") -> None:
        super().__init__(reason)
        self.log = log


def rebuild_command() -> str:
    """What a person runs to build the module against this Python's mlx (for messages that say how)."""
    return f"{sys.executable} -m baselm.cpu.build"


def _cmake() -> str:
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.is_file() else shutil.which("cmake")
    if found is None:
        raise BuildError("cmake not found (pip install cmake)")
    return found


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _run(command: list[str], log: Path, what: str, progress: Any = None) -> None:
    """Runs a build step into `log`; `progress` (start/advance/finish, in percent) follows the
    `[ NN%]` marks cmake's build prints."""
    with log.open("ab") as out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as child:
        done = 0
        for line in child.stdout:
            out.write(line)
            mark = _PERCENT.match(line)
            if progress is not None and mark and int(mark.group(1)) > done:
                progress.advance(int(mark.group(1)) - done)
                done = int(mark.group(1))
    if child.returncode != 0:
        raise BuildError(f"{what} failed", _tail(log))


def _mlx_cmake_dir(mlx_path: Iterable[str]) -> Path:
    # mlx is a namespace package (mlx and mlx-cpu fill it), whose path may list other folders first
    for folder in mlx_path:
        found = Path(folder) / "share" / "cmake" / "MLX"
        if found.is_dir():
            return found
    raise BuildError("mlx's CMake files not found (pip install 'mlx[cpu]')")


def _compile(source_dir: Path, work: Path) -> Path:
    """Configures and builds `source_dir` in `work`; returns the built module."""
    try:
        import mlx
        import nanobind
    except ImportError as exc:
        raise BuildError(f"{exc.name} is not installed") from exc
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        raise BuildError("no C++ compiler found (install g++)")
    log = work / "build.log"
    configure = [
        _cmake(),
        "-S",
        str(source_dir),
        "-B",
        str(work / "cmake"),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dnanobind_DIR={nanobind.cmake_dir()}",
        f"-DMLX_DIR={_mlx_cmake_dir(mlx.__path__)}",
    ]
    _run(configure, log, "configuring the build (cmake)")
    progress = _progress()
    progress.start("the CPU kernels", 100, 0)
    try:
        _run([_cmake(), "--build", str(work / "cmake"), "-j", str(os.cpu_count() or 1)], log, "the compile", progress)
    finally:
        progress.finish()
    built = next((work / "cmake").glob(f"{MODULE_NAME}*.so"), None)
    if built is None:
        raise BuildError(f"the build produced no {MODULE_NAME} module", _tail(log))
    return built


def build(force: bool = False, package_dir: Path = PACKAGE_DIR) -> Path:
    """Compiles the module for `package_dir` (its `csrc/`, into its `_build/`) unless this key's
    build exists; returns its path."""
    target = module_path(package_dir)
    if target.is_file() and not force:
        return target
    root = build_root(package_dir)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="tmp-") as tmp:
        built = _compile(package_dir / "csrc", Path(tmp))
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)  # atomic: a concurrent loader sees no half-written module
    target.with_name(BUILD_ERROR).unlink(missing_ok=True)
    for stale in root.glob("mlx-*"):  # builds for an older mlx or older sources
        if stale != target.parent:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def record_failure(error: BuildError, package_dir: Path = PACKAGE_DIR) -> None:
    """Leaves the error where the module would be, for `paths.missing_reason` to quote: its first
    line is the reason, then the end of the build's log."""
    path = module_path(package_dir).with_name(BUILD_ERROR)
    with contextlib.suppress(OSError):  # a package folder we may not write: the warning still says why
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{error}\n{error.log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baselm.cpu.build", description="Builds baselm.cpu's kernels.")
    parser.add_argument("--force", action="store_true", help="rebuild even if this key's module exists")
    parser.add_argument("--check", action="store_true", help="exit 1 when the module could not be built")
    parser.add_argument(
        "--package-dir", type=Path, default=PACKAGE_DIR, help="the baselm/cpu folder to build for (default: this one)"
    )
    args = parser.parse_args(argv)
    try:
        path = build(args.force, args.package_dir)
    except BuildError as exc:
        record_failure(exc, args.package_dir)
        if exc.log:
            print(exc.log, file=sys.stderr)
        print(f"warning: CPU kernels not built ({exc}); base runs on MLX's own CPU ops", file=sys.stderr)
        return 1 if args.check else 0
    print(f"CPU kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
