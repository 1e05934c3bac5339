"""A llama GGUF written as llama.cpp's converter writes it loads as the HF model it came from.

llama.cpp's converter permutes the q/k projection rows of llama models (it rotates interleaved
pairs where HF rotates halves); store/gguf.py must put them back. The GGUF here is written with
the `gguf` package from the llama fixture, F32 tensors, llama metadata keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import Backend
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.loader import model_from_checkpoint
from baselm.models.base import DecoderModel, ModelConfigError
from baselm.store import gguf as gguf_store
from tests.paths import LLAMA_FIXTURE, MODEL_FIXTURES

TOL = 1e-4
CPU = Backend("cpu", mx.float32, keep_quantized=False)

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


def gguf_tensors(config: dict, permute: bool = True, folder: Path = LLAMA_FIXTURE) -> dict[str, np.ndarray]:
    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    out = {}
    for name, value in weights.items():
        stem = name.removesuffix(".weight")
        if stem in GLOBAL_NAMES:
            out[GLOBAL_NAMES[stem] + ".weight"] = value
            continue
        _, _, layer, rest = stem.split(".", 3)
        if permute and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if rest.endswith("q_proj") else config["num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        out[f"blk.{layer}.{LAYER_NAMES[rest]}.weight"] = value
    return out


def write_gguf(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf(path: Path) -> DecoderModel:
    tensors, metadata = gguf_store.read_metadata(path)
    config = gguf_store.hf_config(metadata, set(tensors))
    weights = gguf_store.hf_tensors(tensors, config)
    return model_from_checkpoint(config, weights, CPU, group_size=gguf_store.GGUF_GROUP_SIZE)


def prefill_logits(model: DecoderModel, ids: np.ndarray) -> np.ndarray:
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    meta = AttentionMetadata.build([[3, 6, 1, 4]], [len(ids)], [len(ids)], 4)
    return np.array(model(mx.array(ids), meta.positions, meta, cache))


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """The divisors llama.cpp's converter stores for llama 3 rope scaling, one per rotary pair."""
    rope = config["rope_parameters"]
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
    return np.where(wavelens < old_len / high, 1.0, np.where(wavelens > old_len / low, factor, medium))


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((LLAMA_FIXTURE / "config.json").read_text())


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(LLAMA_FIXTURE / "reference.npz"))


def test_gguf_with_converter_permuted_qk_rows_gives_the_hf_logits(tmp_path, config, reference):
    model = load_gguf(write_gguf(tmp_path / "llama.gguf", config, gguf_tensors(config)))
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() < TOL


def test_llama3_gguf_with_rope_freqs_and_one_kv_head_gives_the_hf_logits(tmp_path):
    # llama 3 rope scaling lives in a rope_freqs tensor in GGUF; this fixture also ties its
    # embeddings (no output tensor) and has a single KV head.
    folder = MODEL_FIXTURES / "llama_rope3_mqa"
    config = json.loads((folder / "config.json").read_text())
    tensors = gguf_tensors(config, folder=folder)
    assert "output.weight" not in tensors
    tensors["rope_freqs.weight"] = llama3_rope_freqs(config)
    model = load_gguf(write_gguf(tmp_path / "llama3.gguf", config, tensors))
    reference = np.load(folder / "reference.npz")
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() < TOL


def test_gguf_config_matches_the_hf_config(tmp_path, config):
    path = write_gguf(tmp_path / "llama.gguf", config, gguf_tensors(config))
    tensors, metadata = gguf_store.read_metadata(path)
    got = gguf_store.hf_config(metadata, set(tensors))
    keys = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads"]
    assert {k: got[k] for k in keys} == {k: config[k] for k in keys}
    assert got["model_type"] == "llama"
    assert (got["head_dim"], got["vocab_size"], got["tie_word_embeddings"]) == (16, 256, False)


def test_qk_rows_left_in_hf_order_do_not_give_the_hf_logits(tmp_path, config, reference):
    # The unpermuting is what the parity above rests on: skip the converter's permutation and it breaks.
    model = load_gguf(write_gguf(tmp_path / "llama.gguf", config, gguf_tensors(config, permute=False)))
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() > 100 * TOL


def test_gguf_missing_a_tensor_is_named(tmp_path, config):
    tensors = gguf_tensors(config)
    del tensors["blk.1.ffn_down.weight"]
    path = write_gguf(tmp_path / "llama.gguf", config, tensors)
    with pytest.raises(ModelConfigError, match=r"missing layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(path)


def test_gguf_tensor_of_the_wrong_shape_is_named(tmp_path, config):
    tensors = gguf_tensors(config)
    tensors["blk.0.attn_v.weight"] = np.zeros((48, 64), np.float32)  # 3 KV heads' rows where 2 belong
    path = write_gguf(tmp_path / "llama.gguf", config, tensors)
    with pytest.raises(
        ModelConfigError,
        match=r"^tensor layers\.0\.self_attn\.v_proj\.weight has shape \(48, 64\), the config implies \(32, 64\)$",
    ):
        load_gguf(path)
