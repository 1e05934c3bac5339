"""Where the compiled CPU kernels module lives: one folder per build key (see `build.py`)."""

from __future__ import annotations

import hashlib
import sysconfig
from importlib import metadata
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "csrc"
BUILD_ROOT = Path(__file__).parent / "_build"
MODULE_NAME = "_kernels"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def build_key() -> str:
    """What the compiled module depends on: mlx, nanobind, the Python ABI and the sources."""
    digest = hashlib.sha256()
    for name in ("mlx", "nanobind"):
        digest.update(f"{name}={_version(name)};".encode())
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"mlx-{_version('mlx')}-{digest.hexdigest()[:16]}"


def module_path() -> Path:
    """Where the module for the installed mlx and these sources is (or would be)."""
    return BUILD_ROOT / build_key() / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
