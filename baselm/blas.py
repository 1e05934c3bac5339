"""Puts an optimized BLAS under MLX's CPU backend.

The Linux `mlx[cpu]` wheel links the netlib reference BLAS, which runs float32 GEMM at a
few GFLOP/s. Loading OpenBLAS with RTLD_GLOBAL before `mlx.core` is imported makes MLX
resolve `cblas_sgemm` and friends to it: the same results, 40-70x faster matmuls. This
must run before the first `import mlx.core`, so `baselm/__init__.py` calls it.

`BASE_BLAS=0` turns it off; `BASE_BLAS=/path/to/libopenblas.so` picks a library.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

# What happened, for `base doctor`: the library path, or why none was loaded.
status: dict[str, str | None] = {"library": None, "reason": "not attempted"}


def _find_library() -> str | None:
    choice = os.environ.get("BASE_BLAS", "")
    if choice and choice != "1":
        return choice
    return next((p for p in _CANDIDATES if Path(p).is_file()), None)


def preload() -> None:
    """Loads OpenBLAS globally on Linux if it is installed and MLX is not imported yet."""
    if not sys.platform.startswith("linux"):
        status.update(library=None, reason="not needed on this platform (MLX uses Accelerate or the GPU)")
        return
    if os.environ.get("BASE_BLAS") == "0":
        status.update(library=None, reason="disabled by BASE_BLAS=0")
        return
    if "mlx.core" in sys.modules and status["library"] is None:
        status.update(library=None, reason="mlx.core was imported before base could load a BLAS")
        return
    path = _find_library()
    if path is None:
        status.update(library=None, reason="no OpenBLAS found (apt-get install libopenblas0-pthread)")
        return
    try:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        status.update(library=None, reason=f"could not load {path}: {exc}")
        return
    status.update(library=path, reason="loaded")
