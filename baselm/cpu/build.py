"""Builds the CPU kernels module (`python -m baselm.cpu.build`; `make install` runs it).

The module links MLX's C++ library and shares nanobind's type registry with `mlx.core`, so it
only works with the exact mlx wheel it was compiled against. It is built once, at install time,
into `baselm/cpu/_build/<key>/`, the key hashing the mlx version, the Python ABI, the nanobind
version and every kernel source: an upgraded mlx or an edited kernel gets a fresh build and a
stale one is never loaded. It is not built lazily at first use: a compile takes a minute and
needs a compiler, which a `base run` should neither wait for nor require (without the module
base runs on MLX's own ops; `base doctor` says why).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from baselm.cpu.paths import BUILD_ROOT, MODULE_NAME, SOURCE_DIR, module_path


class BuildError(RuntimeError):
    """The kernels could not be compiled here."""


def _cmake() -> str:
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.is_file() else shutil.which("cmake")
    if found is None:
        raise BuildError("cmake not found (pip install cmake)")
    return found


def _run(command: list[str], log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise BuildError(f"{' '.join(command[:3])} ... failed:\n{tail}")


def build(force: bool = False) -> Path:
    """Compiles the module unless this key's build exists; returns its path."""
    target = module_path()
    if target.is_file() and not force:
        return target
    try:
        import mlx
        import nanobind
    except ImportError as exc:
        raise BuildError(f"{exc.name} is not installed") from exc
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        raise BuildError("no C++ compiler found (install g++)")
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD_ROOT, prefix="tmp-") as tmp:
        work = Path(tmp)
        log = work / "build.log"
        _run(
            [
                _cmake(),
                "-S",
                str(SOURCE_DIR),
                "-B",
                str(work / "cmake"),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-Dnanobind_DIR={nanobind.cmake_dir()}",
                f"-DMLX_DIR={Path(mlx.__path__[0]) / 'share' / 'cmake' / 'MLX'}",
            ],
            log,
        )
        _run([_cmake(), "--build", str(work / "cmake"), "-j", str(os.cpu_count() or 1)], log)
        built = next((work / "cmake").glob(f"{MODULE_NAME}*.so"), None)
        if built is None:
            raise BuildError(f"the build produced no {MODULE_NAME} module")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)  # atomic: a concurrent loader sees no half-written module
    for stale in BUILD_ROOT.glob("mlx-*"):  # builds for an older mlx or older sources
        if stale != target.parent:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def main() -> int:
    try:
        path = build(force="--force" in sys.argv)
    except BuildError as exc:
        print(f"warning: CPU kernels not built ({exc}); base runs on MLX's own CPU ops", file=sys.stderr)
        return 0 if "--check" not in sys.argv else 1
    print(f"CPU kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
