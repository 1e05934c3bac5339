"""GGUF K-quants as affine `.base` records (where no block kernel runs them): Q3_K, Q4_K and Q5_K exact,
Q2_K and Q6_K re-quantized with the error measured and logged; pulled, as their blocks.

The oracle is the `gguf` package's dequantizer. It quantizes no K-quant, so the files here are made
of random blocks (tests/tiny_gguf.py `random_blocks`), which it reads like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm import gguf_blocks
from baselm.backend import Backend
from baselm.loader import load_model
from baselm.store import gguf as gguf_store
from baselm.store import gguf_affine, gguf_kquants
from baselm.store.base_reader import BaseFile, read_base_file
from baselm.store.convert import convert
from baselm.store.gguf_kquants import K_SCHEMES, RequantError
from tests.forward import prefill_logits
from tests.tiny_gguf import (
    add_hparams,
    add_word_vocabulary,
    oracle,
    random_blocks,
    same_bits,
    values_of,
    write_gguf,
)

EXACT_K = {"Q3_K": 8, "Q4_K": 4, "Q5_K": 5}
REQUANTIZED_K = {"Q2_K": 4, "Q6_K": 8}
CPU = Backend("cpu", mx.float32, keep_quantized=False)


def read_one(path: Path, errors: dict[str, RequantError] | None = None):
    gguf_file = gguf_store.GGUFFile.open(path)
    return gguf_file.read(gguf_file.tensors["w.weight"], errors)


@pytest.mark.parametrize("type_name", list(EXACT_K))
@pytest.mark.parametrize("seed", [0, 1])
def test_an_exact_k_quant_dequantizes_bit_for_bit_as_gguf_does(type_name: str, seed: int, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 16, 512, seed), type_name)})
    record = read_one(path)
    assert (record.dtype, record.group_size, record.shape) == (f"base_q{EXACT_K[type_name]}", 32, (16, 512))
    assert same_bits(values_of(record), oracle(path)["w.weight"])


def test_q4_k_scales_are_float16_when_every_product_is_a_float16_value(tmp_path: Path) -> None:
    blocks = random_blocks("Q4_K", 4, 256).reshape(4, 1, 144)
    blocks[..., 0:4] = np.array([1.0, 0.5], np.float16).view(np.uint8)  # d = 1, dmin = 0.5: small exact products
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (blocks.reshape(4, -1), "Q4_K")})
    record = read_one(path)
    assert record.scale_dtype == "f16"
    assert same_bits(values_of(record), oracle(path)["w.weight"])


def test_q4_k_scales_are_float32_when_a_product_needs_more_bits(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks("Q4_K", 4, 256), "Q4_K")})
    assert read_one(path).scale_dtype == "f32"  # d * sc of a random f16 d needs up to 17 bits


@pytest.mark.parametrize("type_name", list(REQUANTIZED_K))
def test_a_requantized_k_quant_is_within_half_a_step_and_its_error_is_measured(type_name: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 16, 512), type_name)})
    errors: dict[str, RequantError] = {}
    record = read_one(path, errors)
    assert (record.dtype, record.group_size) == (f"base_q{REQUANTIZED_K[type_name]}", 32)
    expected = oracle(path)["w.weight"]
    error = values_of(record) - expected
    half_step = np.repeat(record.scales.astype(np.float32), 32, axis=1) / 2
    assert (np.abs(error) <= half_step * 1.01 + 1e-6).all()  # plus the rounding of scale and bias to f16
    measured = errors[type_name]
    assert measured.num_values == expected.size and measured.max_error == pytest.approx(np.abs(error).max())
    rms = np.sqrt(np.square(error.astype(np.float64)).mean() / np.square(expected.astype(np.float64)).mean())
    assert measured.relative_rms == pytest.approx(rms)


def test_a_corrupt_q3_k_block_is_a_clear_error(tmp_path: Path) -> None:
    blocks = random_blocks("Q3_K", 2, 256).reshape(2, 1, 110)
    blocks[0, 0, 108:110] = np.array([np.inf], np.float16).view(np.uint8)
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (blocks.reshape(2, -1), "Q3_K")})
    with pytest.raises(gguf_store.ModelFileError, match=r"w\.gguf: tensor 'w\.weight': a Q3_K block"):
        read_one(path)


# ---------------------------------------------------------------------------------------------
# A whole model with K-quant matrices, as Q4_K_M-style files mix them


# A one-layer llama with 256 inputs per matrix (a K-quant super-block); GGUF stem -> (rows, type)
K_MODEL = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
K_MODEL |= {"head_dim": 64, "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 64}
K_MODEL |= {"rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0}, "model_type": "llama"}
K_MODEL |= {"bos_token_id": 1, "eos_token_id": 2}
K_TENSORS = {
    "token_embd": (256, "Q4_K"),
    "blk.0.attn_q": (256, "Q4_K"),
    "blk.0.attn_k": (128, "Q5_K"),
    "blk.0.attn_v": (128, "Q3_K"),
    "blk.0.attn_output": (256, "Q6_K"),
    "blk.0.ffn_gate": (256, "Q4_K"),
    "blk.0.ffn_up": (256, "Q5_K"),
    "blk.0.ffn_down": (256, "Q6_K"),
    "output": (256, "Q2_K"),
}


def k_quant_llama(
    path: Path, types: dict[str, tuple[np.ndarray, str]] | None = None, stems: dict[str, tuple[int, str]] = K_TENSORS
) -> Path:
    """A Q4_K_M-like mix of every K-quant in one llama (or the mix `stems` gives: stem -> (rows, type)),
    as the converter names it; norms F32. `types` maps tensor names to (data, type) put in their place:
    with "F32", the values given."""
    tensors = {}
    for seed, (stem, (rows, kind)) in enumerate(stems.items()):
        tensors[f"{stem}.weight"] = (random_blocks(kind, rows, 256, seed), kind)
    for name, (data, kind) in (types or {}).items():
        tensors[name] = (data, kind)
    for norm in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        tensors[f"{norm}.weight"] = (np.linspace(0.5, 1.5, 256, dtype=np.float32), "F32")

    def metadata(writer) -> None:
        add_hparams(writer, K_MODEL)
        add_word_vocabulary(writer, K_MODEL)

    return write_gguf(path, tensors, metadata)


def test_running_and_pulling_a_k_quant_gguf_give_the_same_logits(tmp_path: Path, caplog) -> None:
    """Pulled with its own quantization, the file's Q2_K ... Q6_K matrices are stored as their blocks
    byte for byte (a version-4 `.base`: Q2_K and Q3_K are version-4 dtypes), nothing re-quantized: this
    backend runs no block kernel, so both loads convert the blocks the same way (Q2_K and Q6_K
    re-quantized then)."""
    path = k_quant_llama(tmp_path / "llama.gguf")
    ids = np.arange(3, 19)
    with caplog.at_level(logging.WARNING, logger="baselm.store.gguf"):
        direct = prefill_logits(load_model(path, CPU).model, ids)
        caplog.clear()
        convert(path, tmp_path / "llama.base", None, None, "default")
    assert not [m for m in caplog.messages if "requantized" in m]  # the pull keeps every block
    pulled = prefill_logits(load_model(tmp_path / "llama.base", CPU).model, ids)
    assert np.array_equal(direct, pulled) and np.isfinite(direct).all()
    _, tensors = read_base_file(tmp_path / "llama.base", verify=True)
    assert BaseFile.open(tmp_path / "llama.base").version == 4
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    kept = {"model.embed_tokens": "token_embd", "model.layers.0.self_attn.q_proj": "blk.0.attn_q"}
    kept |= {"model.layers.0.self_attn.k_proj": "blk.0.attn_k", "model.layers.0.self_attn.o_proj": "blk.0.attn_output"}
    kept |= {"model.layers.0.mlp.up_proj": "blk.0.ffn_up", "model.layers.0.mlp.down_proj": "blk.0.ffn_down"}
    kept |= {"model.layers.0.self_attn.v_proj": "blk.0.attn_v", "lm_head": "output"}
    for hf_name, stem in kept.items():
        stored, (rows, kind) = tensors[f"{hf_name}.weight"], K_TENSORS[stem]
        assert stored.dtype == f"gguf_{kind.lower()}", hf_name
        got, want = np.array(stored.data).reshape(rows, -1), raw[f"{stem}.weight"].reshape(rows, -1)
        if stem in ("blk.0.attn_q", "blk.0.attn_k"):  # rows in HF's order: the converter permuted them for RoPE
            got, want = np.unique(got, axis=0), np.unique(want, axis=0)
        assert np.array_equal(got, want), hf_name


def test_tensors_converted_on_threads_merge_their_errors_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = k_quant_llama(tmp_path / "llama.gguf")
    monkeypatch.setattr(gguf_store, "NUM_READERS", 3)  # every tensor of this small file in flight at once
    checkpoint = gguf_store.GGUFCheckpoint.open(path)
    names = [name for name, _, _ in checkpoint.records()]
    assert names == sorted(names) and len(names) == len(K_TENSORS) + 3  # the norms
    merged = checkpoint.requant_errors["Q6_K"]
    alone: dict[str, RequantError] = {}
    for stem in ("blk.0.ffn_down", "blk.0.attn_output"):  # HF order: mlp.down_proj, then self_attn.o_proj
        checkpoint.file.read(checkpoint.file.tensors[f"{stem}.weight"], alone)
    assert merged.tensors == alone["Q6_K"].tensors == ["blk.0.ffn_down.weight", "blk.0.attn_output.weight"]
    assert (merged.num_values, merged.max_error) == (alone["Q6_K"].num_values, alone["Q6_K"].max_error)
    assert merged.relative_rms == pytest.approx(alone["Q6_K"].relative_rms)


def test_the_tensors_read_the_same_after_the_metadata_is_released(tmp_path: Path) -> None:
    path = k_quant_llama(tmp_path / "llama.gguf")
    _, expected, _ = gguf_store.load_checkpoint(path)
    checkpoint = gguf_store.GGUFCheckpoint.open(path)
    checkpoint.release_metadata()
    assert checkpoint.metadata == {}
    weights = checkpoint.mx_weights()
    assert sorted(weights) == sorted(expected)
    assert all(mx.array_equal(weights[name], expected[name]).item() for name in expected)


def test_k_schemes_name_a_width_mlx_quantizes() -> None:
    for bits, _ in K_SCHEMES.values():
        w = mx.zeros((1, 32))
        mx.quantize(w, group_size=32, bits=bits)


def test_a_requantizing_pull_quantizes_q6_k_once_from_the_gguf_values(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks("Q6_K", 8, 256), "Q6_K")})
    gguf_file = gguf_store.GGUFFile.open(path)
    record = gguf_file.read(gguf_file.tensors["w.weight"], inexact_as_float=True)
    assert record.dtype == "f32" and np.array_equal(record.data, oracle(path)["w.weight"])


def test_pulling_a_k_quant_gguf_as_q4_rounds_its_q6_k_values_once(tmp_path: Path) -> None:
    path = k_quant_llama(tmp_path / "llama.gguf")
    convert(path, tmp_path / "q4.base", "q4", None, "default")
    _, tensors = read_base_file(tmp_path / "q4.base", verify=True)
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # Q6_K in the GGUF
    values = mx.dequantize(
        down.codes, down.scales.astype(mx.float32), down.biases.astype(mx.float32), group_size=32, bits=4
    )
    error = np.abs(np.array(values) - oracle(path)["blk.0.ffn_down.weight"])
    half_step = np.repeat(np.array(down.scales.astype(mx.float32)), 32, axis=1) / 2
    assert (down.bits, down.group_size) == (4, 32) and (error <= half_step * 1.01 + 1e-6).all()


@pytest.mark.parametrize("type_name", [*EXACT_K, *REQUANTIZED_K])
def test_a_large_tensor_decoded_in_chunks_of_rows_gives_the_same_record(
    type_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 10, 512), type_name)})
    whole = read_one(path)
    monkeypatch.setattr(gguf_kquants, "CHUNK_VALUES", 3 * 512)  # chunks of 3 rows: 3 + 3 + 3 + 1
    errors: dict[str, RequantError] = {}
    chunked = read_one(path, errors)
    assert chunked.scale_dtype == whole.scale_dtype
    assert [e.tensors for e in errors.values()] == ([] if type_name in EXACT_K else [["w.weight"]])
    for part in ("codes", "scales", "biases"):
        assert np.array_equal(getattr(chunked, part), getattr(whole, part)), part


def test_an_exact_k_quant_llama_runs_as_its_values_dequantized_by_the_gguf_package(tmp_path: Path) -> None:
    """Q3_K/Q4_K/Q5_K matrices, the q/k rows unpermuted on their codes, scales and biases, lose nothing."""
    exact = {"Q6_K": "Q5_K", "Q2_K": "Q3_K"}
    swapped = {
        f"{stem}.weight": (random_blocks(exact[kind], rows, 256, seed), exact[kind])
        for seed, (stem, (rows, kind)) in enumerate(K_TENSORS.items())
        if kind in exact
    }
    path = k_quant_llama(tmp_path / "k.gguf", swapped)
    values = {name: (v.astype(np.float32), "F32") for name, v in oracle(path).items()}
    as_f32 = k_quant_llama(tmp_path / "f32.gguf", values)
    ids = np.arange(3, 19)
    quantized = prefill_logits(load_model(path, CPU).model, ids)
    assert np.array_equal(quantized, prefill_logits(load_model(as_f32, CPU).model, ids))


@pytest.mark.parametrize("keep_blocks", [False, True])
def test_a_tensor_s_mapped_pages_go_once_the_consumer_has_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_blocks: bool
) -> None:
    """A record that is a view of the mapping (floats, kept blocks) maps its pages back in when the
    consumer copies it into MLX arrays; they are released again after it, so a load holds the
    file's bytes once (a 1.5B Q4_K_M file peaked at twice its size before)."""
    path = k_quant_llama(tmp_path / "llama.gguf")
    checkpoint = gguf_store.GGUFCheckpoint.open(path)
    events: list[tuple[str, str]] = []
    release = checkpoint.file.release
    monkeypatch.setattr(checkpoint.file, "release", lambda info: (events.append(("release", info.name)), release(info)))
    gguf_names = {hf_name: name for hf_name, name, _ in checkpoint._placed}
    kept = frozenset(gguf_blocks.BY_GGUF_TYPE) if keep_blocks else frozenset()
    for name, _, record in checkpoint.records(keep_blocks=kept):
        gguf_affine.record_arrays(name, record)
        events.append(("copied", gguf_names.get(name, name)))
    for index, (event, name) in enumerate(events):
        if event == "copied":
            assert ("release", name) in events[index + 1 :], name
