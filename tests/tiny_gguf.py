"""GGUF files for tests, written with the `gguf` package, and the tiny llama as llama.cpp writes it.

llama.cpp's converter renames HF tensors (`LAYER_NAMES`, `GLOBAL_NAMES`) and permutes the q/k
projection rows of llama models (it rotates interleaved pairs where HF rotates halves);
store/gguf.py must put them back. `tiny_llama_gguf` writes the llama fixture that way, with the
word-level `t0..t255` vocabulary of the hub tests (tests/store/hub_server.py). `fixture_gguf` writes
any model fixture as the converter does for its architecture (`converter_tensors`, `add_hparams`:
Gemma's `1 + w` norms, stacked experts, Phi-3's fused projections and LongRoPE tensors, RoPE
scaling keys). The oracles (`oracle`, `values_of`, `same_bits`) and random K-quant blocks close it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.paths import LLAMA_FIXTURE

if TYPE_CHECKING:  # the fixture script runs this module without MLX
    from baselm.store.base_writer import TensorRecord

T = gguf.GGMLQuantizationType

# HF name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's q/k row order: within each head, HF's two halves interleaved pairwise."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_tensors(config: dict, folder: Path = LLAMA_FIXTURE, permute: bool = True) -> dict[str, np.ndarray]:
    """The checkpoint in `folder` under llama.cpp's names, in HF name order, q/k rows permuted as the
    converter does (left in HF order with `permute=False`)."""
    out = {}
    for name, value in sorted(load_file(str(folder / "model.safetensors")).items()):
        stem = name.removesuffix(".weight")
        if stem in GLOBAL_NAMES:
            out[GLOBAL_NAMES[stem] + ".weight"] = value
            continue
        _, _, layer, rest = stem.split(".", 3)
        if permute and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if rest.endswith("q_proj") else config["num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        out[f"blk.{layer}.{LAYER_NAMES[rest]}.weight"] = np.ascontiguousarray(value)
    return out


def add_llama_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The llama hyperparameters of an HF config, under llama.cpp's metadata keys."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    # llama.cpp also takes one count per layer (`head_count_kv_per_layer`, a key only tests set)
    writer.add_head_count_kv(config.get("head_count_kv_per_layer", config["num_key_value_heads"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_freq_base(_rope(config)["rope_theta"])


def add_word_vocabulary(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The hub tests' word-level vocabulary (`t0`..`t{vocab_size - 1}`) as a GGUF tokenizer."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 `values` as GGUF type `type_name` stores them (the `gguf` package's quantizer)."""
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values, T[type_name])


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, str]],
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    arch: str = "llama",
    split_max_tensors: int = 0,
) -> Path:
    """A GGUF of `tensors` (encoded data, type name) for `arch`, with `metadata` written by the callback.

    With `split_max_tensors`, split as gguf-split does: `path`'s stem `-00001-of-0000n.gguf` and on,
    at most that many tensors each, the metadata in the first part (whose path is returned)."""
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if metadata is not None:
        metadata(writer)
    for name, (data, type_name) in tensors.items():
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(path))[0]


def tiny_llama_gguf(
    path: Path,
    type_name: str,
    folder: Path = LLAMA_FIXTURE,
    more: Callable[[gguf.GGUFWriter], None] | None = None,
    split_max_tensors: int = 0,
) -> tuple[Path, dict[str, Any]]:
    """The llama fixture in `folder` as llama.cpp's converter writes it (q/k rows permuted), 2-D
    weights as `type_name`, norms F32, with the word vocabulary (and the metadata `more` writes);
    and the fixture's HF config. `split_max_tensors`: split into parts as `write_gguf` does."""
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for name, value in llama_cpp_tensors(config, folder).items():
        kind = type_name if value.ndim == 2 else "F32"
        tensors[name] = (encode(value, kind), kind)

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_llama_hparams(writer, config)
        add_word_vocabulary(writer, config)
        if more is not None:
            more(writer)

    return write_gguf(path, tensors, metadata, split_max_tensors=split_max_tensors), config


# ---------------------------------------------------------------------------------------------
# Any model fixture as llama.cpp's `convert_hf_to_gguf.py` writes it (F32 unless told otherwise)

# HF model_type -> GGUF architecture, as the converter registers them (Mistral and Mixtral are llama).
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "smollm3": "smollm3",
}
# Beyond LAYER_NAMES: Gemma's four norms, q/k norms, Phi-3's fused projections, routers.
EXTRA_LAYER_NAMES = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# HF expert projection -> GGUF stacked stem
EXPERT_NAMES = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down", "gate_proj": "ffn_gate", "up_proj": "ffn_up"}
EXPERT_NAMES["down_proj"] = "ffn_down"


def converter_tensors(config: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors renamed, permuted, shifted and stacked as the converter does for `config`'s model_type."""
    model_type = config["model_type"]
    is_gemma = model_type.startswith("gemma")
    out, experts = {}, {}
    for name, value in sorted(weights.items()):
        stem, kind = name.rsplit(".", 1)
        if stem in GLOBAL_NAMES:
            if not (config.get("tie_word_embeddings") and stem == "lm_head"):
                out[f"{GLOBAL_NAMES[stem]}.{kind}"] = value
            continue
        _, _, layer, rest = stem.split(".", 3)
        if ".experts." in rest:  # model.layers.{i}.<moe>.experts.{e}.<proj>: stacked per layer and projection
            _, expert, proj = rest.rsplit(".", 2)
            experts.setdefault((layer, EXPERT_NAMES[proj]), {})[int(expert)] = value
            continue
        names = {**LAYER_NAMES, **EXTRA_LAYER_NAMES, **(GEMMA_NORMS if is_gemma else {})}
        if GGUF_ARCH[model_type] in ("llama", "smollm3") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if rest.endswith("q_proj") else config["num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        out[f"blk.{layer}.{names[rest]}.{kind}"] = value
    for (layer, stem), stack in experts.items():
        out[f"blk.{layer}.{stem}_exps.weight"] = np.stack([stack[e] for e in sorted(stack)])  # (experts, out, in)
    if is_gemma:  # Gemma's RMSNorm scales by 1 + w; the converter stores 1 + w
        out = {k: v + np.float32(1) if k.endswith("norm.weight") else v for k, v in out.items()}
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _rope(config: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    rope = config.get("rope_parameters") or {}
    return dict(rope.get(layer_type, rope))


def add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The converter's metadata keys for `config` (its `set_gguf_parameters` of each model class)."""
    model_type = config["model_type"]
    add_llama_hparams(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    rope = _rope(config)
    rotary = int(config["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if model_type in ("mixtral", "qwen3_moe"):
        writer.add_expert_count(config.get("num_local_experts") or config.get("num_experts"))
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if model_type == "phi3":
        writer.add_sliding_window(config.get("sliding_window") or 0)


def phi3_longrope(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Phi-3's LongRoPE as the converter writes it: two factor tensors, the trained length, the cos/sin scale."""
    rope = _rope(config)
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32),
    }


def add_phi3_longrope_keys(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    rope = _rope(config)
    original = rope["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_rope_scaling_orig_ctx_len(original)


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """The divisors llama.cpp's converter stores for llama 3 rope scaling, one per rotary pair."""
    rope = _rope(config)
    head_dim = config["head_dim"]
    wavelens = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    old_len, low, high, factor = (
        rope["original_max_position_embeddings"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["factor"],
    )
    smooth = (old_len / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelens < old_len / high, 1.0, np.where(wavelens > old_len / low, factor, medium)).astype(
        np.float32
    )


def fixture_gguf(
    path: Path, folder: Path, type_name: str = "F32", config_name: str = "config.json"
) -> tuple[Path, dict[str, Any]]:
    """The model fixture in `folder` (its `config_name` variant) as llama.cpp's converter writes it: F32
    norms and vectors, matrices as `type_name` (F32 by default), the word vocabulary; and its HF config."""
    config = json.loads((folder / config_name).read_text())
    tensors = converter_tensors(config, load_file(str(folder / "model.safetensors")))
    rope_type = _rope(config).get("rope_type")
    if rope_type == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(config)
    if rope_type == "longrope":
        tensors.update(phi3_longrope(config))
    encoded = {}
    for name, value in tensors.items():
        kind = type_name if value.ndim >= 2 else "F32"
        encoded[name] = (encode(value, kind), kind)

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        if rope_type == "longrope":
            add_phi3_longrope_keys(writer, config)
        add_word_vocabulary(writer, config)

    return write_gguf(path, encoded, metadata, arch=GGUF_ARCH[config["model_type"]]), config


# ---------------------------------------------------------------------------------------------
# Oracles and random blocks

BLOCK_LAYOUT = {  # type: (block bytes, byte offsets of the f16 fields: d and dmin / m)
    "Q4_0": (18, (0,)),
    "Q4_1": (20, (0, 2)),
    "Q5_0": (22, (0,)),
    "Q5_1": (24, (0, 2)),
    "Q8_0": (34, (0,)),
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
    "IQ4_NL": (18, (0,)),
    "IQ4_XS": (136, (0,)),
}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / block values * block bytes) random blocks of a GGUF type with its f16 fields (d,
    dmin or m) in [0.001, 0.01): every code the type has, at sane scales.

    The gguf package quantizes no K-quant (its K classes have no `quantize_blocks`), so K-quant
    files are made of such blocks, which its dequantizer reads like any other.
    """
    block_bytes, f16_fields = BLOCK_LAYOUT[type_name]
    num_blocks = cols // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, num_blocks, block_bytes), dtype=np.uint8)
    for at in f16_fields:
        scale = rng.uniform(0.001, 0.01, size=(rows, num_blocks)).astype(np.float16)
        blocks[..., at : at + 2] = scale.view(np.uint8).reshape(rows, num_blocks, 2)
    return blocks.reshape(rows, -1)


def oracle(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as the gguf package reads and dequantizes it (float32, GGUF names and order)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}


def values_of(record: TensorRecord) -> np.ndarray:
    """A record's float32 values: floats as stored, triplets through `mx.dequantize` with f32 scales."""
    import mlx.core as mx

    if record.bits is None:
        if record.dtype == "bf16":
            return np.array(mx.array(record.data).view(mx.bfloat16).astype(mx.float32))
        return record.data.astype(np.float32)
    scales, biases = (mx.array(a) for a in (record.scales, record.biases))
    if record.scale_dtype == "bf16":
        scales, biases = scales.view(mx.bfloat16), biases.view(mx.bfloat16)
    out = mx.dequantize(
        mx.array(record.codes),
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=record.group_size,
        bits=record.bits,
    )
    return np.array(out)


def same_bits(got: np.ndarray, expected: np.ndarray) -> bool:
    """Bit-identical float32, except the sign of zero: gguf's `d * (q - 8)` is -0.0 where d < 0 and
    q = 8, while `scale * q + bias` is +0.0 (x + -x); the two are equal values in every product
    and sum, so `+ 0.0` folds -0.0 into +0.0 on both sides before the bits are compared."""
    return got.dtype == expected.dtype == np.float32 and np.array_equal(
        (got + 0.0).view(np.uint32), (expected + 0.0).view(np.uint32)
    )


def llama_hf_oracle(path: Path, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """A llama GGUF's tensors as the gguf package dequantizes them, under HF names, q/k rows back in
    HF order: the converter's renaming and permutation undone independently of store/gguf.py."""
    hf_names = {f"{v}": k for k, v in {**LAYER_NAMES, **GLOBAL_NAMES}.items()}
    out = {}
    for name, values in oracle(path).items():
        parts = name.split(".")
        if parts[0] == "blk":
            stem = hf_names[parts[2]]
            if stem in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config["num_attention_heads"] if stem.endswith("q_proj") else config["num_key_value_heads"]
                values = values.reshape(heads, -1, 2, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
            out[f"model.layers.{parts[1]}.{stem}.{parts[3]}"] = values
        else:
            out[f"{hf_names[parts[0]]}.{parts[1]}"] = values
    return out
