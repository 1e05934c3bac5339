"""How a kernel is described and launched: one description, run by MLX on Metal or by the emulator.

A `KernelSource` names a Metal body (a package data file), the headers and defines that
precede it, and its input/output names, exactly the arguments of `mx.fast.metal_kernel`.
A `Launch` is one call: inputs in `input_names` order, template arguments, grid and
threadgroup sizes (MLX's `dispatchThreads` convention: the grid counts threads), and the
outputs. Wrappers build launches and hand them to a runner; `run_on_metal` is the real one,
the test suite supplies one that runs the same source under `emulator/metal_emu.h`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

SOURCE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class KernelSource:
    """One kernel's source: the arguments of `mx.fast.metal_kernel` (compiled once per instance)."""

    name: str
    body: str  # file name of the Metal body
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    headers: tuple[str, ...] = ()
    defines: tuple[tuple[str, int], ...] = ()

    def source(self) -> str:
        return (SOURCE_DIR / self.body).read_text()

    def header(self) -> str:
        lines = [f"#define {name} {value}\n" for name, value in self.defines]
        return "".join(lines) + "".join((SOURCE_DIR / h).read_text() for h in self.headers)


@dataclass
class Launch:
    """One call of a kernel: inputs, template arguments, grid and threadgroup, and the outputs' shapes."""

    kernel: KernelSource
    inputs: list[mx.array]
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    init_value: float | None = None


Runner = Callable[[Launch], list[mx.array]]


@functools.cache
def _metal_kernel(kernel: KernelSource):
    return mx.fast.metal_kernel(
        name=kernel.name,
        input_names=list(kernel.input_names),
        output_names=list(kernel.output_names),
        source=kernel.source(),
        header=kernel.header(),
    )


def run_on_metal(launch: Launch) -> list[mx.array]:
    """Runs a launch with `mx.fast.metal_kernel` (compiled once per KernelSource, per template by MLX)."""
    return _metal_kernel(launch.kernel)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        init_value=launch.init_value,
    )
