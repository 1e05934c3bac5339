"""Which path runs: the Metal kernel (checked once per variant against the reference) or the reference.

`paged_attention` and `write_kv` are the public entry points. Kernels run only on an MLX
Metal device, unless `BASE_KERNELS=0`. The first call of each
kernel variant (dtype, shapes, quantization, soft-capping, window, sinks) runs a small case of
the same variant through the kernel and the reference; a compile error or a mismatch
logs one warning and sends every later call of that kernel to the reference.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Hashable

import mlx.core as mx

from baselm.metal import self_check
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.kernels import kernel_supports, paged_attention_kernel, write_kv_kernel
from baselm.metal.kv_quant import Pool, QuantizedPool
from baselm.metal.reference import paged_attention_reference, write_kv_reference

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


def use_kernel(name: str, variant: Hashable, check: Callable[[], None]) -> bool:
    """Whether kernel `name` serves this call; runs `check` (raising on mismatch) once per variant."""
    if not (on_metal() and kernels_enabled()):
        return False
    return passes_self_check(name, variant, check)


def passes_self_check(name: str, variant: Hashable, check: Callable[[], None]) -> bool:
    """Runs `check` once per (kernel, variant); a failure turns the kernel off for good."""
    if name in _failures:
        return False
    if (name, variant) in _checked:
        return True
    try:
        check()
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


def paged_attention(call: AttentionCall) -> mx.array:
    """Paged attention: the Metal kernel where it is available and passed its self-check, else the
    reference (also for a step with two-way spans, which the kernel does not mask). Returns
    (num_tokens, heads, head_dim)."""
    if kernel_supports(call.queries, call.key_pool) and call.meta.attend_until is None:
        check = functools.partial(self_check.check_attention, call)
        if use_kernel("paged_attention", _attention_variant(call), check):
            return paged_attention_kernel(call)
    return paged_attention_reference(call)


def write_kv(write: KVWrite) -> tuple[Pool, Pool]:
    """KV write: quantize-on-write by the Metal kernel where it is available and checked, else the reference."""
    key_pool, keys = write.key_pool, write.keys
    if isinstance(key_pool, QuantizedPool):
        variant = (keys.dtype, keys.shape[1:], key_pool.bits, key_pool.dtype)
        check = functools.partial(self_check.check_write_kv, write)
        if use_kernel("write_kv", variant, check):
            return write_kv_kernel(write)
    return write_kv_reference(write)


def _attention_variant(call: AttentionCall) -> tuple:
    """What a compiled attention kernel depends on: dtypes, shapes, quantization, soft-capping, window, sinks."""
    queries, key_pool = call.queries, call.key_pool
    bits = key_pool.bits if isinstance(key_pool, QuantizedPool) else 16
    shapes = (queries.dtype, queries.shape[1:], key_pool.dtype, key_pool.shape[1:3], bits)
    return (*shapes, call.softcap, call.window, call.sinks is not None)
