"""Runs kernel launches under metal/emulator/metal_emu.h: the Metal source as MLX builds it, on the CPU.

`kernel_source` rebuilds the text `mx.fast.metal_kernel` compiles (header, template line,
the generated signature with `<name>_shape/_strides/_ndim` buffers and the thread
attributes the body mentions, the body, the explicit instantiation); a generated `main`
allocates guarded buffers, runs the grid and writes the outputs. Binaries are cached per
source text under the temp dir, so a kernel variant compiles once per machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from baselm.metal.launch import SOURCE_DIR, KernelSource, Launch

EMULATOR_DIR = SOURCE_DIR / "emulator"
CACHE_DIR = Path(tempfile.gettempdir()) / "baselm_metal_emu"

# MLX's type names in generated signatures (get_type_string).
TYPE_NAMES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.uint16: "uint16_t",
    mx.uint8: "uint8_t",
    mx.int8: "int8_t",
    mx.bool_: "bool",
}
# The thread attributes MLX declares when the body mentions them, in its order, with types.
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
EMULATED_ATTRIBUTES = {
    "grid_size",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "thread_index_in_simdgroup",
    "thread_index_in_threadgroup",
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_grid",
    "threads_per_simdgroup",
    "threads_per_threadgroup",
}
MAX_CONSTANT_ARRAY_SIZE = 8  # smaller inputs go to the constant address space


class EmulatorError(RuntimeError):
    """The emulated kernel failed: out-of-bounds access, barrier misuse, or a crash."""


def _template_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return TYPE_NAMES[value]


def _template_kind(value: object) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"


def _buffer_params(kernel: KernelSource, launch: Launch, source: str) -> list[tuple[str, str, str]]:
    """(declaration, buffer name, role) for each buffer in MLX's binding order."""
    params = []
    for name, arr in zip(kernel.input_names, launch.inputs):
        space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        params.append((f"const {space} {TYPE_NAMES[arr.dtype]}{ref} {name}", name, "input"))
        if arr.ndim > 0:
            for suffix, decl in (
                ("_shape", "const constant int*"),
                ("_strides", "const constant int64_t*"),
                ("_ndim", "const constant int&"),
            ):
                if name + suffix in source:
                    params.append((f"{decl} {name}{suffix}", name + suffix, suffix))
    for name, dtype in zip(kernel.output_names, launch.output_dtypes):
        params.append((f"device {TYPE_NAMES[dtype]}* {name}", name, "output"))
    return params


def kernel_source(kernel: KernelSource, launch: Launch) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """The Metal text MLX would compile, its buffer parameters, and the attributes it declares."""
    source = kernel.source()
    func = f"custom_kernel_{kernel.name}"
    params = _buffer_params(kernel, launch, source)
    attributes = [(a, t) for a, t in ATTRIBUTES if a in source]
    text = kernel.header()
    if launch.template:
        kinds = [_template_kind(v) for _, v in launch.template]
        text += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, launch.template)) + ">\n"
    lines = [f"  {decl} [[buffer({i})]]" for i, (decl, _, _) in enumerate(params)]
    lines += [f"  {t} {a} [[{a}]]" for a, t in attributes]
    text += f"[[kernel]] void {func}(\n" + ",\n".join(lines) + ") {\n" + source + "\n}\n"
    args = "<" + ", ".join(_template_value(v) for _, v in launch.template) + ">" if launch.template else ""
    text += f'template [[host_name("{func}")]] [[kernel]] decltype({func}{args}) {func}{args};\n'
    return text, params, [a for a, _ in attributes]


def _driver(func: str, args: str, params: list[tuple[str, str, str]], attributes: list[str]) -> str:
    """A main() that loads the buffers, runs the grid, and writes the outputs."""
    lines = [
        "int main(int argc, char** argv) {",
        "  using namespace metal_emu;",
        "  install_fault_handler();",
        "  std::string dir = argv[1];",
        "  uint3 grid(std::stoul(argv[2]), std::stoul(argv[3]), std::stoul(argv[4]));",
        "  uint3 group(std::stoul(argv[5]), std::stoul(argv[6]), std::stoul(argv[7]));",
    ]
    call = []
    for i, (decl, name, role) in enumerate(params):
        ctype = decl.rsplit(" ", 1)[0].replace("const constant ", "const ").replace("const device ", "const ")
        ctype = ctype.replace("device ", "")
        lines.append(f'  Buffer b{i} = allocate("{name}", std::stoul(argv[{8 + i}]));')
        if role == "output":
            lines.append(f"  std::memset(b{i}.data, 0xff, b{i}.bytes);")
            lines.append(f'  if (std::getenv("METAL_EMU_INIT_{i}")) read_file(dir + "/b{i}.bin", b{i});')
        else:
            lines.append(f'  read_file(dir + "/b{i}.bin", b{i});')
        if ctype.endswith("&"):
            call.append(f"*({ctype[:-1]}*)b{i}.data")
        else:
            call.append(f"({ctype})b{i}.data")
    for a in attributes:
        if a not in EMULATED_ATTRIBUTES:
            raise EmulatorError(f"the emulator does not supply the attribute {a}")
        call.append(f"a.{a}")
    lines.append(f"  run_grid(grid, group, [&](const Attrs& a) {{ {func}{args}({', '.join(call)}); }});")
    for i, (_, _, role) in enumerate(params):
        if role == "output":
            lines.append(f'  write_file(dir + "/b{i}.bin", b{i});')
    lines.append("  return 0;\n}\n")
    return "\n".join(lines)


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(data: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(data, dtype=np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32, mx.uint32: np.uint32}[dtype]
    return mx.array(np.frombuffer(data, dtype=np_dtype).reshape(shape))


COMPILE_FLAGS = ["-std=c++20", "-O1", "-w"]


def _precompiled_header() -> Path:
    """A folder holding metal_emu.h and its precompiled form (halves each kernel's compile time)."""
    header = (EMULATOR_DIR / "metal_emu.h").read_text()
    folder = CACHE_DIR / f"pch{hashlib.sha256(header.encode()).hexdigest()[:16]}"
    if not (folder / "metal_emu.h.gch").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metal_emu.h").write_text(header)
        cmd = ["g++", *COMPILE_FLAGS, "-x", "c++-header", str(folder / "metal_emu.h"), "-o", str(folder / "tmp.gch")]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(folder / "tmp.gch", folder / "metal_emu.h.gch")
    return folder


def compile_source(text: str) -> Path:
    """The binary for a generated source, compiled once per source text."""
    include = _precompiled_header()
    digest = hashlib.sha256((include.name + text).encode()).hexdigest()[:24]
    binary = CACHE_DIR / f"k{digest}"
    if binary.exists():
        return binary
    src = CACHE_DIR / f"k{digest}.cpp"
    src.write_text(text)
    cmd = ["g++", *COMPILE_FLAGS, "-I", str(include), "-o", f"{binary}.tmp.{os.getpid()}", str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise EmulatorError(f"g++ failed on {src}:\n{done.stderr[-4000:]}")
    os.replace(f"{binary}.tmp.{os.getpid()}", binary)
    return binary


def run_launch(launch: Launch, align: str = "end") -> list[mx.array]:
    """A runner for the kernel wrappers: executes `launch` under the emulator."""
    text, params, attributes = kernel_source(launch.kernel, launch)
    func = f"custom_kernel_{launch.kernel.name}"
    args = "<" + ", ".join(_template_value(v) for _, v in launch.template) + ">" if launch.template else ""
    binary = compile_source('#include "metal_emu.h"\n' + text + _driver(func, args, params, attributes))
    inputs = dict(zip(launch.kernel.input_names, launch.inputs))
    env = dict(os.environ, METAL_EMU_ALIGN=align)
    sizes = []
    with tempfile.TemporaryDirectory() as work:
        outputs = iter(zip(launch.output_shapes, launch.output_dtypes))
        out_specs = []
        for i, (_, name, role) in enumerate(params):
            if role == "output":
                shape, dtype = next(outputs)
                out_specs.append((i, shape, dtype))
                sizes.append(int(np.prod(shape)) * dtype.size)
                if launch.init_value is not None:
                    env[f"METAL_EMU_INIT_{i}"] = "1"
                    Path(work, f"b{i}.bin").write_bytes(_to_bytes(mx.full(shape, launch.init_value, dtype)))
                continue
            data = _input_bytes(role, inputs[name.rsplit("_", 1)[0]] if role != "input" else inputs[name])
            Path(work, f"b{i}.bin").write_bytes(data)
            sizes.append(len(data))
        cmd = [str(binary), work, *map(str, launch.grid), *map(str, launch.threadgroup), *map(str, sizes)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise EmulatorError(f"emulated {launch.kernel.name} exited with {done.returncode}: {done.stderr.strip()}")
        return [_from_bytes(Path(work, f"b{i}.bin").read_bytes(), shape, dtype) for i, shape, dtype in out_specs]


def _input_bytes(role: str, array: mx.array) -> bytes:
    """What an input buffer parameter holds: the array itself, or its shape, strides or rank (`role`)."""
    if role == "input":
        return _to_bytes(array)
    if role == "_shape":
        return np.array(array.shape, np.int32).tobytes()
    if role == "_strides":
        return np.array(_row_strides(array.shape), np.int64).tobytes()
    if role == "_ndim":
        return np.array(array.ndim, np.int32).tobytes()
    raise ValueError(f"unknown buffer role {role!r}")


def _row_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]
