"""A llama GGUF written as llama.cpp's converter writes it loads as the HF model it came from.

llama.cpp's converter permutes the q/k projection rows of llama models (it rotates interleaved
pairs where HF rotates halves); store/gguf.py must put them back. The GGUF here is written with
the `gguf` package from the llama fixture (tests/tiny_gguf.py), F32 tensors, llama metadata keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import Backend
from baselm.loader import model_from_checkpoint
from baselm.models.base import DecoderModel, ModelConfigError
from baselm.store import gguf as gguf_store
from baselm.store.errors import ModelFileError
from tests.forward import prefill_logits
from tests.paths import LLAMA_FIXTURE, MODEL_FIXTURES
from tests.tiny_gguf import add_llama_hparams, llama3_rope_freqs, llama_cpp_tensors, write_gguf

TOL = 1e-4
CPU = Backend("cpu", mx.float32, keep_quantized=False)


def write_f32_gguf(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """`tensors` as F32, with the llama hyperparameters and vocabulary size (no tokenizer)."""

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_llama_hparams(writer, config)
        writer.add_vocab_size(config["vocab_size"])

    f32 = {name: (np.ascontiguousarray(value, dtype=np.float32), "F32") for name, value in tensors.items()}
    return write_gguf(path, f32, metadata)


def load_gguf(path: Path) -> DecoderModel:
    config, weights, _ = gguf_store.load_checkpoint(path)
    return model_from_checkpoint(config, weights, CPU)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((LLAMA_FIXTURE / "config.json").read_text())


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(LLAMA_FIXTURE / "reference.npz"))


def test_gguf_with_converter_permuted_qk_rows_gives_the_hf_logits(tmp_path, config, reference):
    model = load_gguf(write_f32_gguf(tmp_path / "llama.gguf", config, llama_cpp_tensors(config)))
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() < TOL


def test_llama3_gguf_with_rope_freqs_and_one_kv_head_gives_the_hf_logits(tmp_path):
    # llama 3 rope scaling lives in a rope_freqs tensor in GGUF; this fixture also ties its
    # embeddings (no output tensor) and has a single KV head.
    folder = MODEL_FIXTURES / "llama_rope3_mqa"
    config = json.loads((folder / "config.json").read_text())
    tensors = llama_cpp_tensors(config, folder)
    assert "output.weight" not in tensors
    tensors["rope_freqs.weight"] = llama3_rope_freqs(config)
    model = load_gguf(write_f32_gguf(tmp_path / "llama3.gguf", config, tensors))
    reference = np.load(folder / "reference.npz")
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() < TOL


def test_gguf_config_matches_the_hf_config(tmp_path, config):
    path = write_f32_gguf(tmp_path / "llama.gguf", config, llama_cpp_tensors(config))
    got = gguf_store.GGUFCheckpoint.open(path).config
    keys = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads"]
    assert {k: got[k] for k in keys} == {k: config[k] for k in keys}
    assert got["model_type"] == "llama"
    assert (got["head_dim"], got["vocab_size"], got["tie_word_embeddings"]) == (16, 256, False)


def test_qk_rows_left_in_hf_order_do_not_give_the_hf_logits(tmp_path, config, reference):
    # The unpermuting is what the parity above rests on: skip the converter's permutation and it breaks.
    model = load_gguf(write_f32_gguf(tmp_path / "llama.gguf", config, llama_cpp_tensors(config, permute=False)))
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() > 100 * TOL


def test_gguf_missing_a_tensor_is_named(tmp_path, config):
    tensors = llama_cpp_tensors(config)
    del tensors["blk.1.ffn_down.weight"]
    path = write_f32_gguf(tmp_path / "llama.gguf", config, tensors)
    with pytest.raises(ModelConfigError, match=r"missing layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(path)


def test_gguf_tensor_of_the_wrong_shape_is_named(tmp_path, config):
    tensors = llama_cpp_tensors(config)
    tensors["blk.0.attn_v.weight"] = np.zeros((48, 64), np.float32)  # 3 KV heads' rows where 2 belong
    path = write_f32_gguf(tmp_path / "llama.gguf", config, tensors)
    with pytest.raises(
        ModelFileError,
        match=r"^GGUF metadata contradicts its tensors: 2 kv heads of 16 gives 32, but blk\.0\.attn_v\.weight has "
        r"shape \[48, 64\]$",
    ):
        load_gguf(path)
