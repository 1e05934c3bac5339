"""Which path runs: the Metal kernel (checked once per variant against the reference) or the reference.

Kernels run only on an MLX Metal device, unless `BASE_KERNELS=0`. The first call of each
kernel variant (dtype, shapes, quantization, soft-capping, window) runs a small case of
the same variant through the kernel and the reference; a compile error or a mismatch
logs one warning and sends every later call of that kernel to the reference.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable

import mlx.core as mx

log = logging.getLogger("baselm.metal")

KERNEL_NAMES = ("paged_attention", "write_kv")

_failures: dict[str, str] = {}  # kernel name -> why it is off
_checked: set[tuple[str, Hashable]] = set()  # (kernel name, variant) that passed


def kernels_enabled() -> bool:
    """False when the environment sets BASE_KERNELS=0."""
    return os.environ.get("BASE_KERNELS", "1") != "0"


def on_metal() -> bool:
    """Whether MLX runs on a Metal GPU here (where the custom kernels can run)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def use_kernel(name: str, variant: Hashable, self_check: Callable[[], None]) -> bool:
    """Whether kernel `name` serves this call; runs `self_check` (raising on mismatch) once per variant."""
    if not (on_metal() and kernels_enabled()):
        return False
    return passes_self_check(name, variant, self_check)


def passes_self_check(name: str, variant: Hashable, self_check: Callable[[], None]) -> bool:
    """Runs `self_check` once per (kernel, variant); a failure turns the kernel off for good."""
    if name in _failures:
        return False
    if (name, variant) in _checked:
        return True
    try:
        self_check()
    except Exception as error:  # compile errors arrive as RuntimeError from MLX
        reason = " ".join(str(error).split())[:300]
        _failures[name] = reason
        log.warning("Metal kernel %s failed its self-check, using the reference from now on: %s", name, reason)
        return False
    _checked.add((name, variant))
    return True


def kernel_status() -> dict[str, str]:
    """For `base doctor`: each kernel's state on this backend."""
    status = {}
    for name in KERNEL_NAMES:
        if name in _failures:
            status[name] = f"failed self-check: {_failures[name]}"
        elif not on_metal():
            status[name] = "not available on this backend"
        elif not kernels_enabled():
            status[name] = "disabled"
        else:
            status[name] = "used"
    return status
