"""GGUF files for tests, written with the `gguf` package, and the tiny llama as llama.cpp writes it.

llama.cpp's converter renames HF tensors (`LAYER_NAMES`, `GLOBAL_NAMES`) and permutes the q/k
projection rows of llama models (it rotates interleaved pairs where HF rotates halves);
store/gguf.py must put them back. `tiny_llama_gguf` writes the llama fixture that way, with the
word-level `t0..t255` vocabulary of the hub tests (tests/store/hub_server.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.paths import LLAMA_FIXTURE

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
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])


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
    path: Path, tensors: dict[str, tuple[np.ndarray, str]], metadata: Callable[[gguf.GGUFWriter], None] | None = None
) -> Path:
    """A llama GGUF of `tensors` (encoded data, type name), with `metadata` written by the callback."""
    writer = gguf.GGUFWriter(str(path), "llama")
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
    return path


def tiny_llama_gguf(path: Path, type_name: str, folder: Path = LLAMA_FIXTURE) -> tuple[Path, dict[str, Any]]:
    """The llama fixture in `folder` as llama.cpp's converter writes it (q/k rows permuted), 2-D
    weights as `type_name`, norms F32, with the word vocabulary; and the fixture's HF config."""
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for name, value in llama_cpp_tensors(config, folder).items():
        kind = type_name if value.ndim == 2 else "F32"
        tensors[name] = (encode(value, kind), kind)

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_llama_hparams(writer, config)
        add_word_vocabulary(writer, config)

    return write_gguf(path, tensors, metadata), config
