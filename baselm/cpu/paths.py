"""Where the compiled CPU kernels module lives: one folder per build key (see `build.py`).

Every path is under a package folder, `package_dir`: this package by default, or a wheel's copy of
it in setuptools' build folder (setup.py), whose `_build/` the install then carries along. The key
is computed from that folder's own `csrc/`, so it is the key the installed package computes.
"""

from __future__ import annotations

import hashlib
import sysconfig
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).parent
MODULE_NAME = "_kernels"
BUILD_ERROR = "build-error.txt"  # beside where the module would be, when its build failed


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def build_root(package_dir: Path = PACKAGE_DIR) -> Path:
    """The folder that holds one subfolder per build key."""
    return package_dir / "_build"


def build_key(package_dir: Path = PACKAGE_DIR) -> str:
    """What the compiled module depends on: mlx, nanobind, the Python ABI and the sources."""
    digest = hashlib.sha256()
    for name in ("mlx", "nanobind"):
        digest.update(f"{name}={_version(name)};".encode())
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    for path in sorted((package_dir / "csrc").iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"mlx-{_version('mlx')}-{digest.hexdigest()[:16]}"


def module_path(package_dir: Path = PACKAGE_DIR) -> Path:
    """Where the module for the installed mlx and these sources is (or would be)."""
    return build_root(package_dir) / build_key(package_dir) / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"


def missing_reason(package_dir: Path = PACKAGE_DIR) -> str:
    """Why there is no module at `module_path()`, in a few words: its build's error, or the build
    that is there for another mlx (an isolated `pip install` may build against a newer one)."""
    target = module_path(package_dir)
    error = target.with_name(BUILD_ERROR)
    if error.is_file():
        first_line = error.read_text(errors="replace").partition("\n")[0]
        return f"its build failed: {first_line}"
    built = sorted(p.parent.name for p in build_root(package_dir).glob(f"mlx-*/{MODULE_NAME}*"))
    if not built:
        return "not built for this mlx and these sources"
    other_mlx = built[-1].rsplit("-", 1)[0].removeprefix("mlx-")
    if other_mlx != _version("mlx"):
        return f"built for mlx {other_mlx}, not the installed {_version('mlx')}"
    return "built for other kernel sources, nanobind or Python than these"
