"""Reads a GGUF file as an HF-shaped model: config dict, HF tensor names, q/k rows in HF order.

Tensors come from `mx.load`, which keeps Q4_0, Q4_1 and Q8_0 as MLX affine triplets
(`name.weight` uint32 codes, `name.scales`, `name.biases`, group size 32) and reads F32/F16
as they are. Metadata (and the tokenizer vocabulary) are read with the same call.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from baselm.store.errors import ModelFileError, UnsupportedModelError

GGUF_GROUP_SIZE = 32
# Kept under its GGUF name: it has no HF counterpart (HF configs describe llama 3 scaling in rope_scaling).
ROPE_FREQS = "rope_freqs.weight"

# GGUF architecture -> HF model_type. Only architectures whose tensor layout we map.
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias|scales|biases)$")


def _scalar(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_metadata(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """All tensors and metadata of a GGUF file, with clear errors for unreadable files."""
    if not path.is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    try:
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except Exception as exc:  # mx.load raises bare RuntimeError/ValueError on malformed files
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
    return tensors, {k: _scalar(v) for k, v in metadata.items()}


def hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF config.json equivalent of a GGUF header."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "model_type": _ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length", hidden // num_heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = eos
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    missing = [k for k, v in config.items() if v is None]
    if missing:
        raise ModelFileError(f"GGUF metadata lacks {', '.join(missing)} for architecture {arch!r}")
    return config


def _unpermute_rows(w: mx.array, num_heads: int) -> mx.array:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs back to HF halves).

    The permutation moves whole rows, and quantization groups run along the input, so
    codes, scales and biases of a quantized tensor are all unpermuted the same way.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors renamed to HF names, llama-family q/k rows back in HF order.

    `rope_freqs.weight` (llama 3 GGUFs: RoPE frequency divisors, one per rotary pair) keeps its name;
    the llama model's `sanitize` folds it into its RoPE.
    """
    out = {}
    for name, value in tensors.items():
        match = _NAME.match(name)
        base = match and (_LAYER_TENSORS if match.group(1) else _GLOBAL_TENSORS).get(match.group(2))
        if name == ROPE_FREQS:  # llama 3's rope scaling, as per-frequency divisors; the model applies it
            out[name] = value
            continue
        if not base:
            raise UnsupportedModelError(f"GGUF tensor {name!r} has no known place in a {config['model_type']} model")
        layer, kind = match.group(1), match.group(3)
        hf_name = f"model.layers.{layer}.{base}.{kind}" if layer else f"{base}.{kind}"
        if config["model_type"] == "llama" and match.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if match.group(2) == "attn_q" else config["num_key_value_heads"]
            value = _unpermute_rows(value, heads)
        out[hf_name] = value
    return out
