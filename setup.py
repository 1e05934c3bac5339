"""The build steps pyproject.toml cannot declare: compiling baselm.cpu's kernels at install, and
copying the chat page's pinned JavaScript libraries into it (`build_webui`, where npm exists).

`pip install .`, `pip install -e .` and `pip wheel .` run setuptools' `build`, whose sub-command
here, `build_cpu_kernels`, runs `python -m baselm.cpu.build` (what `make install` runs) for the
baselm/cpu that will be imported: the wheel's copy in the build folder, or the source tree itself in
an editable install. The module lands where `baselm.cpu.paths.module_path()` looks, keyed by the mlx
and nanobind of the build environment (pyproject's [build-system] says how those match the
runtime's). A failed build only warns: base then runs on MLX's own CPU ops and says so at start.

Why a setuptools sub-command around our own build script rather than a CMake-aware backend
(scikit-build-core, py-build-cmake): the module's folder is named by a key only
`baselm.cpu.paths` computes, the package must install without a compiler, and `make install`, pip
and a person fixing a stale build should all run the one build that `python -m baselm.cpu.build`
is. It runs as a subprocess because it imports baselm.cpu and mlx, which setuptools' own process
should not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
# Where the kernels are built: Linux, where MLX runs on the CPU (nanobind and cmake are Linux-only
# dependencies; on macOS MLX runs on the Apple GPU).
BUILDS_KERNELS = sys.platform.startswith("linux")
WEBUI_BUILD = ROOT / "api" / "webui" / "build.py"


class BuildCpuKernels(Command):
    """Compiles baselm/cpu/csrc into the package being built (setuptools' SubCommand protocol)."""

    description = "compile baselm.cpu's kernels (python -m baselm.cpu.build)"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False  # set by setuptools for `pip install -e .`

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _package_dir(self) -> Path:
        # NOTE: an editable install imports the source tree, so its module is built there.
        return ROOT / "baselm" / "cpu" if self.editable_mode else Path(self.build_lib) / "baselm" / "cpu"

    def run(self) -> None:
        command = [sys.executable, "-m", "baselm.cpu.build", "--package-dir", str(self._package_dir())]
        done = subprocess.run(command, cwd=ROOT)
        if done.returncode != 0:  # a crash, not a BuildError (those return 0): still not the install's end
            print(
                f"warning: the CPU kernels build exited with {done.returncode}; base runs on MLX's own CPU ops",
                file=sys.stderr,
            )

    def get_outputs(self) -> list[str]:
        if self.editable_mode:
            return []
        return [str(path) for path in (self._package_dir() / "_build").rglob("*") if path.is_file()]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []  # baselm/cpu/csrc is package data already


class BuildWebui(Command):
    """Copies the chat page's pinned npm libraries into the package being built (api/webui/build.py).

    Runs the file by its path: `baselm.api` is `api/` only once installed. Without npm it only warns,
    and the page shows answers as plain text."""

    description = "build the chat page's JavaScript libraries (python -m baselm.api.webui.build)"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _vendor_dir(self) -> Path:
        package = ROOT / "api" if self.editable_mode else Path(self.build_lib) / "baselm" / "api"
        return package / "webui" / "static" / "vendor"

    def run(self) -> None:
        subprocess.run([sys.executable, str(WEBUI_BUILD), "--vendor-dir", str(self._vendor_dir())], cwd=ROOT)

    def get_outputs(self) -> list[str]:
        vendor = self._vendor_dir()
        return [] if self.editable_mode or not vendor.is_dir() else [str(p) for p in vendor.iterdir() if p.is_file()]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


class BuildWithKernels(build):
    sub_commands = [
        *build.sub_commands,
        ("build_cpu_kernels", lambda _: BUILDS_KERNELS),
        ("build_webui", lambda _: shutil.which("npm") is not None),
    ]


class KernelsDistribution(Distribution):
    """A platform wheel (cp311-cp311-linux_x86_64, not py3-none-any) where it may hold the module."""

    def has_ext_modules(self) -> bool:
        return BUILDS_KERNELS


setup(
    cmdclass={"build": BuildWithKernels, "build_cpu_kernels": BuildCpuKernels, "build_webui": BuildWebui},
    distclass=KernelsDistribution,
)
