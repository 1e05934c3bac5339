"""The `.base` v1 writer: layout, round trips through the reader, reproducibility, atomic writes."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from base_helpers import HEADER_FIELDS, NORM_NAME, Q_NAME, entry, small_tensors, split_file, write_small

from baselm.store import gguf
from baselm.store.base_format import BLOB_ALIGN, MATRIX_ALIGN, canonical_json
from baselm.store.base_reader import QuantizedArray, model_weights, read_base_file
from baselm.store.base_writer import TensorRecord, write_base_file
from baselm.store.quantize import quantize

# ---------------------------------------------------------------------------------------------
# Layout


def test_preamble_header_and_blob_start(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    data = path.read_bytes()
    magic, version, header_len = struct.unpack_from("<4sIQ", data)
    header = json.loads(data[16 : 16 + header_len])
    blob_start = BLOB_ALIGN  # the small header fits in the first 64 KiB
    assert (magic, version) == (b"BASE", 1)
    assert data[16 : 16 + header_len] == canonical_json(header)
    assert data[16 + header_len : blob_start] == bytes(blob_start - 16 - header_len)
    assert header["schema"] == "base.v1" and header["alignment"] == {"blob": 65536, "matrix": 16384, "vector": 64}
    assert {k: header[k] for k in HEADER_FIELDS} == HEADER_FIELDS
    last = max(header["tensors"], key=lambda t: t["offset"])
    assert len(data) == blob_start + last["offset"] + last["length"]


def test_regions_are_aligned_and_back_to_back(tmp_path: Path) -> None:
    header, _ = split_file(write_small(tmp_path / "m.base"))
    layout = [(t["name"], t["offset"], t["length"]) for t in header["tensors"]]
    assert layout == [
        (Q_NAME, 0, 8 * 128 // 2 + 2 * 8 * 2 * 2),  # q4 codes + f16 scales and biases, 2 groups a row
        (NORM_NAME, 576, 64 * 4),  # a vector: next 64-byte boundary
        ("model.layers.0.mlp.down_proj.weight", MATRIX_ALIGN, 4 * 64 * 3 // 8 + 2 * 4 * 2 * 2),
        ("model.embed_tokens.weight", 2 * MATRIX_ALIGN, 6 * 128 + 2 * 6 * 1 * 2),
        ("model.norm.weight", 2 * MATRIX_ALIGN + 832, 64 * 2),
        ("lm_head.bias", 2 * MATRIX_ALIGN + 960, 6 * 2),
        ("model.extra.weight", 3 * MATRIX_ALIGN, 3 * 5 * 2),  # a 2-D float tensor is a matrix region
    ]
    q = entry(header, Q_NAME)
    assert (q["scale_offset"], q["bias_offset"], q["group_size"], q["scale_dtype"]) == (512, 544, 64, "f16")


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4)])
def test_float_tensors_round_trip_bit_exactly(tmp_path: Path, dtype: str, shape: tuple[int, ...]) -> None:
    source = mx.random.normal(shape, key=mx.random.key(1)).astype(
        {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[dtype]
    )
    path = write_base_file(tmp_path / "f.base", [("t", source)], **HEADER_FIELDS)
    header, tensors = read_base_file(path, verify=True)
    loaded = tensors["t"]
    assert entry(header, "t")["dtype"] == dtype
    assert loaded.dtype == source.dtype and loaded.shape == source.shape
    assert np.array_equal(
        np.array(loaded.view(mx.uint16 if dtype != "f32" else mx.uint32)),
        np.array(source.view(mx.uint16 if dtype != "f32" else mx.uint32)),
    )


def test_from_array_converts_float_dtypes_on_request(tmp_path: Path) -> None:
    values = np.array([1.0, -2.5, 3.140625, 65504.0], dtype=np.float32)
    path = write_base_file(tmp_path / "c.base", [("t", TensorRecord.from_array(values, "bf16"))], **HEADER_FIELDS)
    _, tensors = read_base_file(path)
    assert tensors["t"].dtype == mx.bfloat16
    assert np.array(tensors["t"].astype(mx.float32)).tolist() == [1.0, -2.5, 3.140625, 65536.0]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_round_trip_within_half_a_step(tmp_path: Path, bits: int, group_size: int) -> None:
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = rng.standard_normal((16, 256)).astype(np.float32)  # (out, in)
    path = write_base_file(tmp_path / "q.base", [("w.weight", quantize(w, bits, group_size, "f32"))], **HEADER_FIELDS)
    _, tensors = read_base_file(path, verify=True)
    q = tensors["w.weight"]
    assert isinstance(q, QuantizedArray)
    assert (q.bits, q.group_size, q.shape) == (bits, group_size, (16, 256))
    assert q.codes.dtype == mx.uint32 and q.codes.shape == (16, 256 * bits // 32)
    assert q.scales.shape == q.biases.shape == (16, 256 // group_size)
    dense = np.array(q.dequantize())  # (out, in)
    error = np.abs(dense - w).reshape(16, -1, group_size).max(axis=-1)
    step = np.array(q.scales)
    assert (error <= step / 2 + 1e-6 * np.abs(w).max()).all()
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))  # (tokens, in)
    product = mx.quantized_matmul(x, q.codes, q.scales, q.biases, transpose=True, group_size=group_size, bits=bits)
    np.testing.assert_allclose(np.array(product), np.array(x) @ dense.T, rtol=1e-4, atol=1e-4)


def test_empty_and_zero_sized_tensors(tmp_path: Path) -> None:
    empty = write_base_file(tmp_path / "e.base", [], **HEADER_FIELDS)
    assert empty.stat().st_size == BLOB_ALIGN and read_base_file(empty, verify=True)[1] == {}
    path = write_base_file(
        tmp_path / "z.base", [("a", np.zeros((0,), np.float32)), ("b", np.ones(3, np.float16))], **HEADER_FIELDS
    )
    _, tensors = read_base_file(path, verify=True)
    assert tensors["a"].shape == (0,) and tensors["b"].tolist() == [1.0, 1.0, 1.0]


def test_header_text_survives_any_unicode(tmp_path: Path) -> None:
    tokenizer = {"tokenizer.json": {"vocab": {"\udc80": 0, "日本": 1, "é": 2}}, "chat_template": "{{ '✓' }}"}
    path = write_base_file(tmp_path / "u.base", [], **{**HEADER_FIELDS, "tokenizer": tokenizer})
    header, _ = read_base_file(path, verify=True)
    assert header["tokenizer"] == tokenizer


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_mlx_triplets_are_stored_as_they_are(tmp_path: Path, bits: int) -> None:
    codes, scales, biases = mx.quantize(
        mx.random.normal((4, 128), key=mx.random.key(0)).astype(mx.float16), group_size=32, bits=bits
    )
    record = TensorRecord.from_triplet(codes, scales, biases, group_size=32)
    assert (record.dtype, record.shape, record.scale_dtype) == (f"base_q{bits}", (4, 128), "f16")
    _, tensors = read_base_file(
        write_base_file(tmp_path / "t.base", [("w.weight", record)], **HEADER_FIELDS), verify=True
    )
    loaded = tensors["w.weight"]
    assert all(mx.array_equal(a, b).item() for a, b in zip(loaded[:3], (codes, scales, biases)))
    with pytest.raises(ValueError, match="not an MLX triplet of group 32"):
        TensorRecord.from_triplet(codes, scales, biases[:, :2], group_size=32)


def test_model_weights_flatten_triplets_with_group_sizes(tmp_path: Path) -> None:
    _, tensors = read_base_file(write_small(tmp_path / "m.base"))
    weights, group_sizes = model_weights(tensors)
    assert group_sizes == {
        "model.layers.0.self_attn.q_proj": 64,
        "model.layers.0.mlp.down_proj": 32,
        "model.embed_tokens": 128,
    }
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (8, 16)  # codes
    assert weights["model.layers.0.self_attn.q_proj.scales"].shape == (8, 2)
    assert weights["model.embed_tokens.biases"].dtype == mx.bfloat16
    assert len(weights) == 3 * 3 + 4


# ---------------------------------------------------------------------------------------------
# Reproducibility and atomic writes


def test_same_inputs_give_identical_bytes(tmp_path: Path) -> None:
    first = write_small(tmp_path / "a.base").read_bytes()
    second = write_small(tmp_path / "b.base").read_bytes()
    streamed = write_base_file(tmp_path / "c.base", iter(small_tensors()), **HEADER_FIELDS).read_bytes()
    assert first == second == streamed


@pytest.mark.parametrize("reserve", [0, 5 * BLOB_ALIGN])
def test_header_reservation_does_not_change_the_bytes(tmp_path: Path, reserve: int) -> None:
    """The blob is moved into its canonical place whether the reserved header area was too small or too big."""
    many = [(f"layer.{i}.weight", np.full((2, 3), i, dtype=np.float32)) for i in range(300)]
    expected = write_base_file(tmp_path / "a.base", many, **HEADER_FIELDS).read_bytes()
    moved = write_base_file(tmp_path / "b.base", iter(many), **HEADER_FIELDS, _reserve_bytes=reserve).read_bytes()
    assert moved == expected
    assert len(expected) > 2 * BLOB_ALIGN  # 300 matrix regions: the blob spans many reservations


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    before = path.read_bytes()

    def broken():
        yield "a.weight", np.ones((2, 2), dtype=np.float32)
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError, match="source went away"):
        write_base_file(path, broken(), **HEADER_FIELDS)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.base"]


def test_writer_rejects_bad_header_fields_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^header field 'config' must be dict, not list$"):
        write_base_file(tmp_path / "h.base", [], **{**HEADER_FIELDS, "config": []})
    with pytest.raises(
        ValueError, match=r"^header fields are not plain JSON \(Out of range float values are not JSON compliant"
    ):
        write_base_file(tmp_path / "h.base", [], **{**HEADER_FIELDS, "config": {"eps": float("nan")}})
    assert os.listdir(tmp_path) == []


def test_writer_rejects_duplicate_names_and_integer_arrays(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        write_base_file(
            tmp_path / "d.base", [("a", np.ones(2, np.float32)), ("a", np.ones(2, np.float32))], **HEADER_FIELDS
        )
    with pytest.raises(ValueError, match="dtype int64"):
        write_base_file(tmp_path / "i.base", [("a", np.ones(2, np.int64))], **HEADER_FIELDS)


# ---------------------------------------------------------------------------------------------
# The real model


@pytest.mark.slow
def test_smollm2_gguf_triplets_round_trip_bit_exactly(tmp_path: Path, smollm2_gguf: Path) -> None:
    """GGUF Q4_1/Q8_0 triplets go into a .base file as they are and come back identical."""

    config, source, _ = gguf.load_checkpoint(smollm2_gguf)

    def records():
        for name, value in source.items():
            prefix = name.removesuffix(".weight")
            if name.endswith((".scales", ".biases")):
                continue
            if f"{prefix}.scales" in source:
                yield name, TensorRecord.from_triplet(value, source[f"{prefix}.scales"], source[f"{prefix}.biases"], 32)
            else:
                yield name, value

    path = write_base_file(tmp_path / "smollm2.base", records(), **{**HEADER_FIELDS, "config": config})
    header, tensors = read_base_file(path, verify=True)
    weights, group_sizes = model_weights(tensors)
    assert header["config"] == config
    assert set(weights) == set(source) and set(group_sizes.values()) == {32}
    assert {t["dtype"] for t in header["tensors"]} == {"base_q4", "base_q8", "f32"}
    for name, value in source.items():
        assert weights[name].dtype == value.dtype and mx.array_equal(weights[name], value).item(), name
