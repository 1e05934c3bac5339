"""The `.base` v1 container: layout, round trips, reproducibility, atomic writes, validation."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from base_helpers import CREATED, HEADER_FIELDS, assemble, entry, rewrite_header, small_tensors, split_file, write_small

from baselm.store.base_file import (
    BLOB_ALIGN,
    MATRIX_ALIGN,
    MAX_HEADER_LEN,
    BaseFile,
    QuantizedArray,
    TensorRecord,
    canonical_json,
    inspect_report,
    model_weights,
    read_base_file,
    render_inspect,
    write_base_file,
)
from baselm.store.errors import BaseFileError, ModelFileError
from baselm.store.quantize import quantize

Q_NAME = "model.layers.0.self_attn.q_proj.weight"
NORM_NAME = "model.layers.0.input_layernorm.weight"


def _problem(path: Path, verify: bool = False) -> str:
    with pytest.raises(BaseFileError) as info:
        read_base_file(path, verify=verify)
    assert str(path) in str(info.value)
    return info.value.problem


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
# Validation: preamble and header


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none.base"
    with pytest.raises(BaseFileError) as info:
        BaseFile.open(path)
    assert info.value.problem == "it cannot be read (No such file or directory)"
    assert isinstance(info.value, ModelFileError)


def test_short_file(tmp_path: Path) -> None:
    path = tmp_path / "s.base"
    path.write_bytes(b"BASE\x01")
    assert _problem(path) == "it is 5 bytes long, shorter than the 16-byte preamble"


def test_bad_magic(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    path.write_bytes(b"GGUF" + path.read_bytes()[4:])
    assert _problem(path) == "its magic is b'GGUF', not b'BASE'"


def test_other_version(tmp_path: Path) -> None:
    header, blob = split_file(write_small(tmp_path / "m.base"))
    path = assemble(tmp_path / "m.base", canonical_json(header), blob, version=2)
    assert _problem(path) == "its version is 2, and this build reads version 1"


def test_huge_header_len_is_rejected_without_reading(tmp_path: Path) -> None:
    header, blob = split_file(write_small(tmp_path / "m.base"))
    path = assemble(tmp_path / "m.base", canonical_json(header), blob, header_len=2**63)
    size = path.stat().st_size
    assert _problem(path) == f"its header length {2**63} runs past the end of the {size}-byte file"


def test_header_len_over_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.base"
    with open(path, "wb") as f:  # a sparse file big enough to hold the claimed header
        f.write(struct.pack("<4sIQ", b"BASE", 1, MAX_HEADER_LEN + 1))
        f.truncate(MAX_HEADER_LEN + 4096)
    assert _problem(path) == f"its header length {MAX_HEADER_LEN + 1} exceeds the {MAX_HEADER_LEN}-byte limit"


@pytest.mark.parametrize(
    ("header_bytes", "problem"),
    [
        (b"\xff{}", "its header is not UTF-8 (byte 0)"),
        (b'{"a": ', "its header is not valid JSON (Expecting value: line 1 column 7 (char 6))"),
        (b'{"a": NaN}', "its header is not valid JSON (NaN is not valid JSON)"),
        (
            b"[" * 100000 + b"]" * 100000,
            "its header is not valid JSON (maximum recursion depth exceeded while decoding a JSON array from a unicode string)",
        ),
        (b"[1, 2]", "its header is a JSON list, not an object"),
        (
            b'{"a": ' + b"9" * 5000 + b"}",
            "its header is not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)",
        ),
    ],
)
def test_unparseable_headers(tmp_path: Path, header_bytes: bytes, problem: str) -> None:
    path = assemble(tmp_path / "m.base", header_bytes, b"")
    assert _problem(path) == problem


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda h: h.pop("arch"), "its header lacks arch"),
        (lambda h: h.update(extra=1), "its header has unknown keys extra"),
        (lambda h: h.update(config=[]), "header field 'config' is a list, expected dict"),
        (
            lambda h: h.update(quant_profile=3),
            "header field 'quant_profile' is a int, expected str or dict or NoneType",
        ),
        (lambda h: h.update(schema="base.v2"), "its schema is 'base.v2', and this build reads 'base.v1'"),
        (
            lambda h: h["alignment"].update(matrix=4096),
            "its alignment {'blob': 65536, 'matrix': 4096, 'vector': 64} differs from the v1 rule {'blob': 65536, 'matrix': 16384, 'vector': 64}",
        ),
        (lambda h: h.update(flags=[1]), "header field 'flags' must be a list of strings"),
    ],
)
def test_header_fields_are_checked(tmp_path: Path, mutate, problem: str) -> None:
    assert _problem(rewrite_header(write_small(tmp_path / "m.base"), mutate)) == problem


def test_nonzero_padding(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    data = bytearray(path.read_bytes())
    data[BLOB_ALIGN - 1] = 7
    path.write_bytes(bytes(data))
    header_end = 16 + struct.unpack_from("<Q", data, 8)[0]
    assert (
        _problem(path) == f"the padding between its header and blob (bytes {header_end}..{BLOB_ALIGN}) is not all zero"
    )


def test_file_ending_before_the_blob(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    path.write_bytes(path.read_bytes()[: BLOB_ALIGN - 10])
    assert _problem(path) == f"it is {BLOB_ALIGN - 10} bytes long and ends before its tensor blob at byte {BLOB_ALIGN}"


# ---------------------------------------------------------------------------------------------
# Validation: tensor entries and layout


def _set(tensor: str, **fields):
    return lambda h: entry(h, tensor).update(fields)


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda h: h["tensors"].append(5), "tensor entry 7 is not a JSON object"),
        (
            _set(NORM_NAME, dtype="f64"),
            f"tensor {NORM_NAME!r} has dtype 'f64'; expected one of f32, f16, bf16, base_q2, base_q3, base_q4, base_q5, base_q6, base_q8",
        ),
        (_set(NORM_NAME, group_size=32), f"tensor {NORM_NAME!r} (f32) has missing or unexpected keys: group_size"),
        (
            lambda h: entry(h, Q_NAME).pop("bias_offset"),
            f"tensor {Q_NAME!r} (base_q4) has missing or unexpected keys: bias_offset",
        ),
        (_set(NORM_NAME, name=""), "tensor entry 1 has no name"),
        (
            _set(NORM_NAME, shape=[64.0]),
            f"tensor {NORM_NAME!r} has shape [64.0]; expected a list of at most 8 non-negative integers",
        ),
        (
            _set(NORM_NAME, shape=[1] * 9),
            f"tensor {NORM_NAME!r} has shape {[1] * 9}; expected a list of at most 8 non-negative integers",
        ),
        (_set(NORM_NAME, offset=-64), f"tensor {NORM_NAME!r} has offset -64; expected a non-negative integer"),
        (_set(NORM_NAME, length=True), f"tensor {NORM_NAME!r} has length True; expected a non-negative integer"),
        (
            _set(NORM_NAME, checksum_xxh64="XYZ"),
            f"tensor {NORM_NAME!r} has checksum_xxh64 'XYZ'; expected 16 lowercase hex digits",
        ),
        (_set(NORM_NAME, name=Q_NAME), f"tensor {Q_NAME!r} appears twice in its header"),
        (_set(Q_NAME, shape=[8, 2, 64]), f"tensor {Q_NAME!r} is quantized but has 3 dimensions, not 2"),
        (_set(Q_NAME, group_size=16), f"tensor {Q_NAME!r} has group_size 16; expected 32, 64 or 128"),
        (_set(Q_NAME, shape=[8, 96]), f"tensor {Q_NAME!r} has 96 input features, not a multiple of its group size 64"),
        (_set(Q_NAME, scale_dtype="f8"), f"tensor {Q_NAME!r} has scale_dtype 'f8'; expected f32, f16 or bf16"),
        (_set(Q_NAME, dtype="base_q5"), f"tensor {Q_NAME!r} has length 576, but base_q5 [8, 128] takes 704 bytes"),
        (
            _set(NORM_NAME, shape=[2**40, 2**40]),
            f"tensor {NORM_NAME!r} has length 256, but f32 [{2**40}, {2**40}] takes {2**82} bytes",
        ),
        (
            _set(Q_NAME, scale_offset=520),
            f"tensor {Q_NAME!r} has scale_offset 520 and bias_offset 544, expected 512 and 544 (codes, scales, biases back to back)",
        ),
        (_set(NORM_NAME, offset=600), f"tensor {NORM_NAME!r} starts at blob offset 600, not a multiple of 64"),
        (
            _set("model.extra.weight", offset=MATRIX_ALIGN + 64),
            "tensor 'model.extra.weight' starts at blob offset 16448, not a multiple of 16384",
        ),
        (
            _set("model.extra.weight", offset=4 * MATRIX_ALIGN),
            f"tensor 'model.extra.weight' ends at blob offset {4 * MATRIX_ALIGN + 30}, past the blob end {3 * MATRIX_ALIGN + 30}",
        ),
        (_set(NORM_NAME, offset=512), f"tensors {Q_NAME!r} and {NORM_NAME!r} overlap in the blob"),
    ],
)
def test_tensor_entries_are_checked(tmp_path: Path, mutate, problem: str) -> None:
    assert _problem(rewrite_header(write_small(tmp_path / "m.base"), mutate)) == problem


def test_truncated_blob(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    path.write_bytes(path.read_bytes()[:-1])
    assert (
        _problem(path)
        == f"tensor 'model.extra.weight' ends at blob offset {3 * MATRIX_ALIGN + 30}, past the blob end {3 * MATRIX_ALIGN + 29}"
    )


# ---------------------------------------------------------------------------------------------
# Checksums


def test_flipped_blob_byte_fails_verification_only(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    data = bytearray(path.read_bytes())
    data[BLOB_ALIGN + 600] ^= 0x10  # inside the layer norm's values
    path.write_bytes(bytes(data))
    read_base_file(path)  # the layout is intact, so an unverified load succeeds
    problem = _problem(path, verify=True)
    assert problem.startswith(f"tensor {NORM_NAME!r} fails its checksum (xxh64 ")
    with pytest.raises(BaseFileError, match="fails its checksum"):
        BaseFile.open(path).verify()


def test_changed_header_value_fails_verification(tmp_path: Path) -> None:
    path = rewrite_header(write_small(tmp_path / "m.base"), lambda h: h["config"].update(hidden_size=65))
    read_base_file(path)
    assert _problem(path, verify=True).startswith("the header fails its checksum (xxh64 ")


# ---------------------------------------------------------------------------------------------
# Inspection


def test_inspect_report_lists_tensors_and_totals(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    report = inspect_report(path, verify=True)
    assert report["arch"] == "llama" and report["quant_profile"] == "default-q4" and report["verified"] is True
    assert report["created"] == CREATED and report["file_bytes"] == path.stat().st_size
    assert report["tensors"][0] == {
        "name": Q_NAME,
        "dtype": "base_q4",
        "shape": [8, 128],
        "group_size": 64,
        "bytes": 576,
    }
    assert report["totals"]["tensors"] == 7
    assert report["totals"]["params"] == 8 * 128 + 64 + 4 * 64 + 6 * 128 + 64 + 6 + 15
    assert report["totals"]["by_dtype"]["base_q4"] == {"tensors": 1, "params": 1024, "bytes": 576}
    assert report["totals"]["bytes"] == sum(row["bytes"] for row in report["tensors"])


def test_render_inspect_prints_the_table(tmp_path: Path) -> None:
    from rich.console import Console

    console = Console(record=True, width=160)
    render_inspect(inspect_report(write_small(tmp_path / "m.base")), console)
    text = console.export_text()
    assert Q_NAME in text and "base_q4" in text and "8x128" in text and "not checked" in text


# ---------------------------------------------------------------------------------------------
# The real model


@pytest.mark.slow
def test_smollm2_gguf_triplets_round_trip_bit_exactly(tmp_path: Path, smollm2_gguf: Path) -> None:
    """GGUF Q4_1/Q8_0 triplets go into a .base file as they are and come back identical."""
    from baselm.store import gguf

    raw, metadata = gguf.read_metadata(smollm2_gguf)
    config = gguf.hf_config(metadata, set(raw))
    source = gguf.hf_tensors(raw, config)

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
