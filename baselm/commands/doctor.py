"""`base doctor`: what this machine offers the runtime, and what will make it slow or fail."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from typing import Any

import mlx.core as mx
from rich.table import Table
from rich.text import Text

from baselm import blas, cpu
from baselm.backend import device_memory_bytes, gpu_kind, select_backend, system_memory_bytes
from baselm.commands import doctor_links as dist_doctor
from baselm.commands import doctor_pd as pd_doctor
from baselm.commands import doctor_speed
from baselm.commands.console import table_console
from baselm.config import format_size
from baselm.cpu.build import rebuild_command
from baselm.cpu.fused import fused_kernel_status
from baselm.metal import kernel_status
from baselm.paged_attention import attention_kernel_status
from baselm.store.default_model import base_home


def collect(links: bool = False, speed: bool = True) -> dict[str, Any]:
    """Everything doctor reports, as plain data (the --json output); `links` also measures a
    2-rank group on loopback, `speed` the decode speed to expect (doctor_speed.py, ~2 s)."""
    kind = gpu_kind()
    backend = kind or "cpu"
    home = base_home()
    disk = shutil.disk_usage(home if home.exists() else home.parent if home.parent.exists() else "/")
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "backend": backend,
        "device": mx.device_info().get("device_name", "unknown") if hasattr(mx, "device_info") else "unknown",
        "device_memory_bytes": device_memory_bytes() if kind else None,
        "system_memory_bytes": system_memory_bytes(),
        "cpu_count": os.cpu_count(),
        "blas": (blas.status["library"] or "MLX's bundled reference BLAS") if backend == "cpu" else "not used (GPU)",
        "blas_status": blas.status["reason"],
        "compute": _cpu_compute() if backend == "cpu" else "quantized weights on the GPU",
        "cpu_kernels": {
            "loaded": cpu.available(),
            "isa": cpu.kernels.isa() if cpu.available() else None,
            "threads": cpu.kernels.num_threads() if cpu.available() else None,
            "reason": cpu.status["reason"],
        },
        "kernels": {**kernel_status(), **attention_kernel_status(), **fused_kernel_status()},
        "store": str(home),
        "store_free_bytes": disk.free,
        "distributed": {**dist_doctor.collect(links), "prefill_decode": pd_doctor.status()},
        "speed": doctor_speed.measure_speed(select_backend("auto")) if speed else None,
        "warnings": [],
    }
    report["warnings"] = _warnings(report)
    return report


def _cpu_compute() -> str:
    if cpu.available():
        return f"{cpu.describe()}: quantized weights kept quantized, decoded inside the matmul"
    why = cpu.status["reason"] if cpu.status["reason"] == cpu.DISABLED else "not loaded: see the warning"
    return f"float32 (quantized weights dequantized at load) on MLX's own ops; CPU kernels {why}"


def _warnings(report: dict[str, Any]) -> list[str]:
    warnings = []
    if report["backend"] == "cpu":
        warnings.append("No GPU: MLX runs on the CPU, where decode is bound by memory reads (Speed says how fast).")
        if not cpu.available() and cpu.status["reason"] != cpu.DISABLED:
            warnings.append(
                f"CPU kernels not loaded ({cpu.status['reason']}): decode runs through BLAS GEMM on float32 "
                f"weights, several times slower and larger in memory. Build them: {rebuild_command()}"
            )
        if blas.status["library"] is None and sys.platform.startswith("linux"):
            warnings.append(
                f"No optimized BLAS ({blas.status['reason']}): matmuls run on the reference BLAS, "
                "about 40x slower. Install one: apt-get install libopenblas0-pthread"
            )
    memory = report["device_memory_bytes"] or report["system_memory_bytes"]
    if memory is not None and memory < 8 * 2**30:
        warnings.append(f"Only {format_size(memory)} of memory: models above ~1B parameters may not fit.")
    if report["store_free_bytes"] < 5 * 2**30:
        warnings.append(f"Only {format_size(report['store_free_bytes'])} free where models are stored.")
    return warnings


def _kernels_line(states: dict[str, str], cpu_reason: str) -> str:
    """Kernels that share a state named together, the state once; the CPU kernels' reason for being
    off is said where it is acted on (Compute, or the warning with the fix), not once per kernel."""
    by_state: dict[str, list[str]] = {}
    for name, state in states.items():
        by_state.setdefault(state.replace(f"off: {cpu_reason}", "off (see Compute)"), []).append(name)
    return "; ".join(f"{', '.join(names)}: {state}" for state, names in by_state.items())


def _gib(n: int | None) -> str:
    return "unknown" if n is None else format_size(n)


def render(report: dict[str, Any]) -> None:
    """The report as a table, then its warnings."""
    console = table_console()
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("Python", report["python"]),
        ("Platform", report["platform"]),
        ("MLX", report["mlx"]),
        ("Backend", f"{report['backend']} ({report['device']})"),
        ("Memory", f"device {_gib(report['device_memory_bytes'])}, system {_gib(report['system_memory_bytes'])}"),
        ("CPU cores", str(report["cpu_count"])),
        ("BLAS", f"{report['blas']} ({report['blas_status']})"),
        ("Compute", report["compute"]),
        ("Kernels", _kernels_line(report["kernels"], report["cpu_kernels"]["reason"])),
        ("Store", f"{report['store']} ({_gib(report['store_free_bytes'])} free)"),
        ("Distributed", f"{dist_doctor.summary(report['distributed'])}; {pd_doctor.describe(report['distributed'])}"),
        ("Speed", doctor_speed.describe(report["speed"])),
    ]
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if not report["warnings"]:
        console.print("[green]All good.[/]")
