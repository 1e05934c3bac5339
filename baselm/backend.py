"""Which device runs the model and how weights are held there."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import mlx.core as mx

from baselm import cpu

DEVICES = ("auto", "gpu", "cpu")


class BackendError(RuntimeError):
    """The requested device is not available."""


@dataclass(frozen=True, slots=True)
class Backend:
    """The device in use and the weight policy that is fast on it.

    GPUs keep quantized weights quantized. On the CPU with `baselm.cpu`'s kernels loaded,
    quantized weights stay quantized too and linear layers run through the kernels; without
    them only float32 matmul is fast (BLAS), so quantized weights are dequantized at load.
    """

    name: str  # "metal", "cuda" or "cpu"
    compute_dtype: mx.Dtype
    keep_quantized: bool
    cpu_kernels: bool = False  # linear layers through baselm.cpu's kernels

    @property
    def linear_path(self) -> str:
        """Which matmuls run: for `base doctor` and `base bench`."""
        if self.is_gpu:
            return f"MLX {self.name} (quantized weights kept)"
        if self.cpu_kernels:
            return cpu.describe() + ", quantized weights kept"
        return f"MLX CPU ops, weights widened to float32 ({cpu.describe()})"

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"

    def memory_bytes(self) -> int | None:
        """The memory weights and KV pools share here: the GPU's, else the system's (None: unknown)."""
        return (device_memory_bytes() if self.is_gpu else None) or system_memory_bytes()


def gpu_kind() -> str | None:
    """'metal' or 'cuda' when MLX has a GPU here, else None."""
    if not mx.is_available(mx.gpu):
        return None
    if platform.system() == "Darwin" and mx.metal.is_available():
        return "metal"
    return "cuda"


def select_backend(device: str = "auto") -> Backend:
    """Makes `device` MLX's default and returns the policy for it."""
    if device not in DEVICES:
        raise BackendError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    kind = gpu_kind()
    if device == "gpu" and kind is None:
        raise BackendError("no GPU is available to MLX here; use --device cpu")
    if device == "cpu" or kind is None:
        mx.set_default_device(mx.cpu)
        return Backend("cpu", mx.float32, keep_quantized=cpu.available(), cpu_kernels=cpu.available())
    mx.set_default_device(mx.gpu)
    return Backend(kind, mx.bfloat16 if kind == "cuda" else mx.float16, keep_quantized=True)


def system_memory_bytes() -> int | None:
    """Physical memory of this machine, when the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory the OS could give this process now (Linux's MemAvailable), else the machine's physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return system_memory_bytes()


def device_memory_bytes() -> int | None:
    """Memory MLX may use on the default device, when MLX reports it."""
    try:
        info = mx.device_info()
    except Exception:  # older MLX, or no device info on this backend
        return None
    return info.get("memory_size") or info.get("total_memory")
