"""`base bench --synthetic`: decode speed against model size, beside the memory roofline.

Each size is a Llama-shaped model with seeded random weights, quantized as the store keeps
them (affine groups of 32, float16 scales) and built through the same path as a real model.
Decoding one token reads every weight once, so `bandwidth / weight bytes` bounds tok/s; the
bandwidth is measured here: a plain forward read of a 512 MiB buffer by every core (or, without
the CPU kernels, a float32 matrix through MLX's matmul).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from baselm.backend import Backend
from baselm.commands.errors import report_user_errors
from baselm.config import ConfigError, EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.models import build_model
from baselm.tokenizer.tokenizer import Tokenizer

# Shapes of real checkpoints: SmolLM2-135M, SmolLM2-360M, Llama-3.2-1B (tied embeddings).
SHAPES: dict[str, dict[str, int]] = {
    "135M": {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
             "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152},
    "360M": {"hidden_size": 960, "num_hidden_layers": 32, "intermediate_size": 2560,
             "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152},
    "1B": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
}  # fmt: skip
GROUP_SIZE = 32
CHUNK_ROWS = 4096  # rows generated at a time, so a float32 copy of a large table never exists whole


@dataclass(frozen=True, slots=True)
class SyntheticArgs:
    """What `base bench --synthetic SIZES` does: which random-weight models, where, how to print."""

    sizes: tuple[str, ...]  # names in SHAPES
    bits: int = 4  # 4 or 8 (affine, groups of 32); 32: float32
    device: str = "auto"
    gen_tokens: int = 64
    seed: int = 0
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8, 32):
            raise ConfigError(f"--synthetic-bits must be 4, 8 or 32, got {self.bits}")


def bench_synthetic(args: SyntheticArgs) -> None:
    """Runs every size and prints the report (JSON with `as_json`)."""
    from baselm.backend import select_backend

    with report_user_errors():
        bits = None if args.bits == 32 else args.bits
        report = run_synthetic(list(args.sizes), bits, select_backend(args.device), args.gen_tokens, args.seed)
    if args.as_json:
        print(json.dumps(report, indent=2))
    else:
        render_synthetic(report)


def synthetic_config(size: str) -> dict[str, Any]:
    if size not in SHAPES:
        raise ConfigError(f"unknown synthetic size {size!r}; choose from {', '.join(SHAPES)}")
    return {
        "model_type": "llama",
        **SHAPES[size],
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


def _matrix_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """HF name -> (out, in) of every matrix of a Llama config with tied embeddings."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        })  # fmt: skip
    return shapes


def _random_matrix(shape: tuple[int, int], bits: int | None, seed: int) -> dict[str, mx.array]:
    """A seeded random (out, in) matrix: float32, or an affine triplet with float16 scales."""
    parts: dict[str, list[mx.array]] = {}
    for start in range(0, shape[0], CHUNK_ROWS):
        rows = min(CHUNK_ROWS, shape[0] - start)
        values = 0.02 * mx.random.normal((rows, shape[1]), key=mx.random.key(seed * 7919 + start))
        chunk = (
            {"weight": values}
            if bits is None
            else dict(zip(("weight", "scales", "biases"), mx.quantize(values, GROUP_SIZE, bits)))
        )
        if bits is not None:
            chunk["scales"], chunk["biases"] = chunk["scales"].astype(mx.float16), chunk["biases"].astype(mx.float16)
        mx.eval(chunk)
        for name, value in chunk.items():
            parts.setdefault(name, []).append(value)
    out = {name: mx.concatenate(values) if len(values) > 1 else values[0] for name, values in parts.items()}
    mx.eval(out)
    return out


def synthetic_weights(config: dict[str, Any], bits: int | None, seed: int) -> dict[str, mx.array]:
    """Every tensor of the model, HF names: matrices random (quantized unless bits is None), norms ones."""
    weights: dict[str, mx.array] = {}
    for index, (name, shape) in enumerate(_matrix_shapes(config).items()):
        prefix = name.removesuffix(".weight")
        for part, value in _random_matrix(shape, bits, seed * 1_000_003 + index).items():
            weights[f"{prefix}.{part}"] = value
    h = config["hidden_size"]
    for i in range(config["num_hidden_layers"]):
        weights[f"model.layers.{i}.input_layernorm.weight"] = mx.ones((h,))
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = mx.ones((h,))
    weights["model.norm.weight"] = mx.ones((h,))
    return weights


def _plain_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level vocabulary of `vocab_size` ids: the engine detokenizes what it generates."""
    backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return Tokenizer(backend, special_tokens={}, add_bos_token=False, add_eos_token=False, chat_template=None)


def synthetic_model(size: str, bits: int | None, backend: Backend, seed: int) -> tuple[LoadedModel, int]:
    """(the loaded model, bytes of weights one decode step reads: every matrix once)."""
    config = synthetic_config(size)
    weights = synthetic_weights(config, bits, seed)
    weight_bytes = sum(v.nbytes for k, v in weights.items() if "norm" not in k)
    model = build_model(
        config, weights, backend.compute_dtype, keep_quantized=backend.keep_quantized,
        cpu_kernels=backend.cpu_kernels, consume=True,
    )  # fmt: skip
    tokenizer = _plain_tokenizer(config["vocab_size"])
    name = f"synthetic-{size}"
    return LoadedModel(name, Path(name), model, tokenizer, config, (), backend), weight_bytes


def stream_bandwidth(backend: Backend, num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a plain forward read of a `num_bytes` buffer by every core (the CPU kernels'
    threads), the memory roofline; without the kernels, of one activation row against a float32
    matrix through MLX's matmul."""
    from baselm import cpu

    w = mx.ones((num_bytes // (4 * 2048), 2048))  # the values do not change a read's speed; random ones took seconds
    x = mx.ones((1, 2048))
    mx.eval(w, x)
    if backend.cpu_kernels:
        run = lambda: cpu.kernels.read_xor(w)  # noqa: E731
    else:
        run = lambda: mx.eval(x @ w.T)  # noqa: E731
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return w.nbytes / best


def run_synthetic(sizes: list[str], bits: int | None, backend: Backend, gen_tokens: int, seed: int) -> dict[str, Any]:
    """Decode tok/s of one stream per size, with the roofline `bandwidth / weight bytes`."""
    from baselm.commands.bench import throughput

    bandwidth = stream_bandwidth(backend)
    rows = []
    for size in sizes:
        loaded, weight_bytes = synthetic_model(size, bits, backend, seed)
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_model_len=256, kv_memory=64 * 2**20))
        throughput(engine, 1, 8, 4, seed)  # warm-up
        result = throughput(engine, 1, 16, gen_tokens, seed)
        rows.append({
            "size": size,
            "weight_bytes": weight_bytes,
            "decode_tok_s": result["decode_tok_s_per_stream"],
            "roofline_tok_s": round(bandwidth / weight_bytes, 1),
        })  # fmt: skip
        del engine, loaded
        mx.clear_cache()
    quant = "f32" if bits is None else f"q{bits}"
    return {"quant": quant, "bandwidth_gb_s": round(bandwidth / 1e9, 2), "matmuls": backend.linear_path, "models": rows}


def render_synthetic(report: dict[str, Any]) -> None:
    console = Console()
    console.print(
        f"synthetic {report['quant']} models; matmuls: {report['matmuls']}; "
        f"measured read bandwidth {report['bandwidth_gb_s']} GB/s",
        highlight=False,
    )
    table = Table("size", "weights MiB", "decode tok/s", "roofline tok/s", "of roofline")
    for r in report["models"]:
        share = 100 * r["decode_tok_s"] / r["roofline_tok_s"] if r["roofline_tok_s"] else 0.0
        table.add_row(r["size"], f"{r['weight_bytes'] / 2**20:.0f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['roofline_tok_s']:.1f}", f"{share:.0f}%")  # fmt: skip
    console.print(table)
