"""CPU kernels that MLX runs inside its graph: few-row float32 and quantized matmuls.

MLX's CPU backend runs every matmul as a BLAS GEMM and has no quantized CPU matmul, so a
decode step (one activation row per sequence) reads float32 weights through sgemm at a
fraction of DRAM speed. The compiled module (`csrc/`, built by `baselm.cpu.build`) adds
primitives that stream each weight once, straight from its quantized form.

`kernels` is the module, or None with `status["reason"]` saying why: not built for this mlx,
no compiler at install time, `BASE_CPU_KERNELS=0`, or not a CPU this applies to.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

import mlx.core as mx

from baselm.cpu.paths import MODULE_NAME, missing_reason, module_path

# What happened, for `base doctor`: "loaded" with the module path, or why not.
status: dict[str, str | None] = {"path": None, "reason": "not attempted"}
DISABLED = "disabled by BASE_CPU_KERNELS=0"  # the reason when a person turned them off


def _probe(module: ModuleType) -> None:
    """Raises unless the module's arrays are mx.arrays (a nanobind/mlx ABI mismatch fails here)."""
    x = mx.ones((1, 32))
    y = module.dense_linear(x, mx.ones((2, 32)))
    if not isinstance(y, mx.array) or mx.array_equal(y, mx.full((1, 2), 32.0)).item() is not True:
        raise ImportError("the module's dense_linear gave a wrong answer")


def _load() -> ModuleType | None:
    if os.environ.get("BASE_CPU_KERNELS", "1") == "0":
        status.update(reason=DISABLED)
        return None
    path = module_path()
    if not path.is_file():
        status.update(reason=missing_reason())
        return None
    spec = importlib.util.spec_from_file_location(f"baselm.cpu.{MODULE_NAME}", path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _probe(module)
    except Exception as exc:  # any failure to load means the reference path, with the reason kept
        status.update(reason=f"could not load {path.name}: {exc}")
        return None
    sys.modules[spec.name] = module
    status.update(path=str(path), reason="loaded")
    return module


kernels: Any = _load()


def available() -> bool:
    """Whether the compiled kernels are loaded and usable."""
    return kernels is not None


def describe() -> str:
    """One line for `base doctor` and `base bench`: which CPU path runs and why."""
    if kernels is None:
        return f"MLX reference ops ({status['reason']})"
    return f"base CPU kernels ({kernels.isa()}, {kernels.num_threads()} threads, {activations()})"


def activations() -> str:
    """What quantized weights are multiplied with: integer activation codes (the default, up to
    `qdot_max_rows` rows a call, and for GGUF blocks the integer GEMM from `block_gemm_min_rows` rows
    where the ISA has it) or float32 ones (BASE_CPU_EXACT=1, the exact path)."""
    if kernels is None or kernels.exact():
        return "float32 activations"
    bits, isa = kernels.activation_bits(), kernels.qdot_isa()
    head = f"{bits}-bit integer activations up to {kernels.qdot_max_rows()} rows ({isa})"
    if not kernels.integer_gemm():
        return f"{head}, beyond: float32"
    gemm = f"GGUF blocks in the integer GEMM from {kernels.block_gemm_min_rows()} rows"
    return f"{head}, {gemm}, beyond: float32 otherwise"
