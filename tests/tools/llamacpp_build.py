"""llama.cpp for tests/tools/bench_vs_llamacpp.py: its programs built once from the llama-cpp-python
sdist, and the test files made with them.

The first call of `build_llama_cpp` builds llama.cpp (llama-bench, llama-batched-bench, llama-server,
llama-quantize) from the `llama-cpp-python` sdist on PyPI (`pip download --no-binary`; nothing of it is
copied here) with `-DGGML_NATIVE=ON`, about 11 minutes on 2 cores, into the cache folder it is given
(bench_vs_llamacpp uses `~/.cache/base/llama.cpp/<version>-<native_hash()>/`: the hash is of the CPU's
flags and the compiler, so a build never runs on a machine it was not made for). A failed build keeps
its log there (`build.log`).

Test files are made as users get them: random-weight Qwen2.5-0.5B- and 1.5B-shaped F16 GGUFs (the real
shapes, tied embeddings, Qwen2's own 151936-token tokenizer from the sdist's `ggml-vocab-qwen2.gguf`),
quantized by `llama-quantize` to Q4_0, Q4_K_M, Q5_K_M, Q6_K and Q8_0, cached in `<cache>/models/`,
each made only when asked for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from baselm.store.default_model import default_gguf_path
from tests.llama_cpp_files import SDIST_REQUIREMENT, fetch_models_dir

VERSION = SDIST_REQUIREMENT.partition("==")[2]
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
QUANTS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
BUILD_TIMEOUT_S = 3600
THREADS = 2


class BenchError(Exception):
    """A one-line reason the run cannot go on (no compiler, no network, a failed build)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """A Qwen2.5 model's shape: what sets its weights' sizes and so its speed."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 151936


SHAPES = {
    "0.5b": Shape(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "1.5b": Shape(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960),
}


# ---------------------------------------------------------------------------------------------
# Subprocesses and the llama.cpp build


def run_tool(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, log: Path | None = None) -> str:
    """`cmd`'s stdout (with `log`, its output goes there as it comes instead); a BenchError naming the
    program when it is missing, runs past `timeout_s` or fails (its first error line, and `log`)."""
    name, where = Path(cmd[0]).name, f"; log: {log}" if log is not None else ""
    try:
        if log is None:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        else:
            with log.open("a") as out:
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    except FileNotFoundError:
        raise BenchError(f"{name} is not installed (looked for {cmd[0]})") from None
    except subprocess.TimeoutExpired:
        raise BenchError(f"{name} ran past its {timeout_s:.0f} s timeout: {' '.join(cmd)}{where}") from None
    if result.returncode != 0:
        output = log.read_text() if log is not None else result.stderr
        lines = output.strip().splitlines()
        first_error = [line for line in lines if "error" in line.lower()][:1]  # a compiler's, not make's last
        raise BenchError(f"{name} failed: {(first_error or lines[-1:] or ['no output'])[0].strip()}{where}")
    return result.stdout or ""


def compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return path
    raise BenchError("no C++ compiler found: install one (apt-get install g++) to build llama.cpp")


def native_hash() -> str:
    """What a `-DGGML_NATIVE=ON` build depends on: the CPU's flags and the compiler's version."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else os.uname().machine
    flags = next((line for line in cpu.splitlines() if line.startswith(("flags", "Features"))), cpu)
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return hashlib.sha256((flags + "".join(version)).encode()).hexdigest()[:10]


def bin_dir(cache: Path) -> Path:
    return cache / "build" / "bin"


def fetch_source(cache: Path) -> Path:
    """llama.cpp's source, unpacked from the sdist into `<cache>/src` once."""
    source = cache / "src" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp]
        try:
            run_tool([*pip, SDIST_REQUIREMENT], timeout_s=600)
        except BenchError as exc:
            raise BenchError(f"could not download {SDIST_REQUIREMENT} (no network to PyPI?): {exc}") from None
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = next(p for p in Path(tmp).iterdir() if p.is_dir())
        shutil.rmtree(cache / "src", ignore_errors=True)
        unpacked.rename(cache / "src")  # whole or not at all
    return source


def build_llama_cpp(cache: Path) -> Path:
    """The folder of the llama.cpp programs, built into `cache` the first time."""
    bins = bin_dir(cache)
    if all((bins / t).exists() for t in TARGETS):
        return bins
    cxx = compiler()
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if cmake is None:
        raise BenchError("cmake is not installed: pip install cmake (into the venv) to build llama.cpp")
    source = fetch_source(cache)
    log = cache / "build.log"
    log.write_text("")
    print(f"building llama.cpp {VERSION} into {cache} (about 11 minutes on 2 cores; log: {log})", file=sys.stderr)
    configure = [cmake, "-S", str(source), "-B", str(cache / "build"), f"-DCMAKE_CXX_COMPILER={cxx}", *CMAKE_FLAGS]
    run_tool(configure, timeout_s=600, log=log)
    jobs = str(os.cpu_count() or 2)
    run_tool([cmake, "--build", str(cache / "build"), "--target", *TARGETS, "-j", jobs], BUILD_TIMEOUT_S, log=log)
    return bins


# ---------------------------------------------------------------------------------------------
# Test files: random-weight Qwen2.5-shaped GGUFs, quantized by llama-quantize


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path) -> None:
    """Every `tokenizer.*` key of the vocabulary-only GGUF `vocab`, as it is there."""
    for key, field in gguf.GGUFReader(str(vocab)).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def add_hparams(writer: gguf.GGUFWriter, shape: Shape, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)


def random_tensors(shape: Shape, seed: int) -> dict[str, np.ndarray]:
    """Qwen2's tensors under llama.cpp's names: weights F16 (std 0.02), norms and biases F32; the
    output layer is the embedding (tied), so no `output.weight`."""
    rng = np.random.default_rng(seed)
    hidden, kv = shape.hidden_size, shape.hidden_size // shape.num_heads * shape.num_kv_heads

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)  # (out, in)

    tensors = {"token_embd.weight": weight(shape.vocab_size, hidden)}
    for i in range(shape.num_layers):
        b = f"blk.{i}"
        tensors |= {f"{b}.attn_norm.weight": np.ones(hidden, np.float32)}
        for proj, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            tensors[f"{b}.{proj}.weight"] = weight(rows, hidden)
            tensors[f"{b}.{proj}.bias"] = rng.standard_normal(rows, dtype=np.float32) * 0.02
        tensors[f"{b}.attn_output.weight"] = weight(hidden, hidden)
        tensors[f"{b}.ffn_norm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{b}.ffn_gate.weight"] = weight(shape.intermediate_size, hidden)
        tensors[f"{b}.ffn_up.weight"] = weight(shape.intermediate_size, hidden)
        tensors[f"{b}.ffn_down.weight"] = weight(hidden, shape.intermediate_size)
    tensors["output_norm.weight"] = np.ones(hidden, np.float32)
    return tensors


def write_f16(path: Path, size: str) -> Path:
    """The random-weight Qwen2.5-`size`-shaped F16 GGUF at `path` (written once)."""
    if path.exists():
        return path
    vocab_dir, why = fetch_models_dir()
    if vocab_dir is None:
        raise BenchError(f"no Qwen2 vocabulary for the test files: {why}")
    print(f"writing {path.name}", file=sys.stderr)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "qwen2")
    add_hparams(writer, SHAPES[size], f"Qwen2.5-{size.upper()}-shaped random weights")
    copy_tokenizer(writer, vocab_dir / "ggml-vocab-qwen2.gguf")
    for name, tensor in random_tensors(SHAPES[size], seed=0).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def made_path(name: str, cache: Path) -> Path:
    size, _, quant = name.partition("-")
    return cache / "models" / f"qwen2.5-{size}-shaped-{quant}.gguf"


def make_file(name: str, bins: Path, cache: Path) -> Path:
    """The test file `name` ("0.5b-q4_k_m"), written and quantized the first time it is asked for."""
    path = made_path(name, cache)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    size = name.partition("-")[0]
    f16 = write_f16(cache / "models" / f"qwen2.5-{size}-shaped-f16.gguf", size)
    print(f"quantizing {path.name}", file=sys.stderr)
    partial = path.with_suffix(".partial")
    quant = name.partition("-")[2].upper()
    run_tool([str(bins / "llama-quantize"), str(f16), str(partial), quant, str(THREADS)], timeout_s=1800)
    partial.rename(path)
    return path


def quant_of(path: Path) -> str:
    """The quantization a GGUF names in general.file_type ("Q4_K_M"), or "?" where it names none."""
    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "?"
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


MADE = tuple(f"{size}-{q.lower()}" for size in SHAPES for q in QUANTS)


def resolve_names(names: list[str], cache: Path) -> list[tuple[str, Path]]:
    """Each name with its file: a test file (made when benchmarked), `smollm2` (base's default model) or
    a GGUF path; checked before anything is built."""
    files = []
    for name in names:
        if name in MADE:
            path = made_path(name, cache)
        elif name == "smollm2":
            path = default_gguf_path()
            if not path.exists():
                raise BenchError(f"SmolLM2 is not downloaded yet: run `base run` once (it fetches {path.name})")
        elif (path := Path(name).expanduser()).is_file():
            name = path.stem
        else:
            raise BenchError(f"unknown file {name!r}: give a GGUF path, smollm2 or one of {', '.join(MADE)}")
        files.append((name, path))
    return files
