"""GGUF tensors as `.base` tensors: exact for F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, re-quantized
within the scheme's bound for K-quants, refused by name for everything else.

Every file here is written with the `gguf` package's GGUFWriter; the oracle for the values is
the same package's reader and `gguf.quants.dequantize`. The package can quantize only the
legacy types (its K-quant classes have no `quantize_blocks`), so K-quant files are made from
random blocks with sane `d`/`dmin` fields, which its dequantizer reads like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm.store import gguf as gguf_store
from baselm.store.base_reader import QuantizedArray, read_base_file
from baselm.store.base_writer import TensorRecord
from baselm.store.convert import convert
from baselm.store.convert_gguf import _kept_gguf
from baselm.store.errors import UnsupportedModelError
from baselm.store.gguf_quants import pack_affine
from baselm.store.quantize import pack_codes
from tests.paths import TOKENIZER_FIXTURES
from tests.tiny_gguf import T, encode, tiny_llama_gguf, write_gguf

EXACT = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


def weights(rows: int = 64, cols: int = 128, seed: int = 0) -> np.ndarray:
    """Values of every scale: normal rows, a tiny row (subnormal f16 block scales), a zero row."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)  # (rows, cols)
    w[1] *= 1e-6
    w[2] = 0
    return w


def oracle(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as the gguf package reads and dequantizes it (float32)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}


def values_of(record: TensorRecord) -> np.ndarray:
    """A record's float32 values: floats as stored, triplets through `mx.dequantize` with f32 scales."""
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


def read_one(path: Path, name: str = "w.weight") -> TensorRecord | np.ndarray:
    gguf_file = gguf_store.GGUFFile.open(path)
    return gguf_file.read(gguf_file.tensors[name])


@pytest.mark.parametrize("type_name", EXACT)
def test_a_gguf_tensor_becomes_a_base_tensor_that_dequantizes_bit_for_bit_as_gguf_does(
    type_name: str, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (encode(weights(), type_name), type_name)})
    record = read_one(path)
    expected = oracle(path)["w.weight"]
    assert isinstance(record, TensorRecord) and record.shape == (64, 128)
    if type_name in BITS:
        assert (record.dtype, record.group_size, record.scale_dtype) == (f"base_q{BITS[type_name]}", 32, "f16")
    else:
        assert record.dtype == type_name.lower()
    assert same_bits(values_of(record), expected)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q8_0"])
def test_a_block_whose_zero_point_bias_overflows_f16_keeps_f32_scales_and_stays_exact(
    type_name: str, tmp_path: Path
) -> None:
    # -8d, -16d and -128d overflow f16 once |w| passes ~65000, though d itself fits.
    w = weights(8, 64)
    w[3, :32] = np.linspace(-70000, 30000, 32)
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (encode(w, type_name), type_name)})
    record = read_one(path)
    expected = oracle(path)["w.weight"]
    assert record.scale_dtype == "f32"
    assert same_bits(values_of(record), expected)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_are_packed_as_mlx_packs_them(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(4, 128), dtype=np.uint8)  # (out, in)
    packed = pack_affine(codes, bits)  # (out, in * bits / 32)
    assert np.array_equal(packed, pack_codes(codes, bits))
    ones, zeros = mx.ones((4, 128 // 32)), mx.zeros((4, 128 // 32))
    unpacked = mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), codes.astype(np.float32))
    # And MLX's own quantizer's codes read back through the same layout.
    w = mx.random.normal((4, 128), key=mx.random.key(bits))
    mlx_codes, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    assert np.array_equal(np.array(mlx_codes), pack_affine(_unpack(np.array(mlx_codes), bits), bits))


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    stream = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")  # (out, in * bits)
    stream = stream.reshape(packed.shape[0], -1, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# K-quants: dequantized by the gguf package, re-quantized at their own width


K_LAYOUT = {  # type: (block bytes, byte offsets of the f16 fields d and dmin)
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}
K_BITS = {"Q2_K": (2, 32), "Q3_K": (3, 32), "Q4_K": (4, 64), "Q5_K": (5, 64), "Q6_K": (6, 64)}


def random_k_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, cols / 256 * block bytes) random K-quant blocks with d, dmin in [0.001, 0.01)."""
    block_bytes, f16_fields = K_LAYOUT[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    for at in f16_fields:
        scale = rng.uniform(0.001, 0.01, size=(rows, cols // 256)).astype(np.float16)
        blocks[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def test_the_gguf_package_quantizes_no_k_quant_so_the_k_files_here_are_made_of_random_blocks() -> None:
    for type_name in K_LAYOUT:
        with pytest.raises(NotImplementedError):
            gguf.quants.quantize(np.zeros((1, 256), np.float32), T[type_name])


@pytest.mark.parametrize("type_name", list(K_LAYOUT))
def test_a_k_quant_is_dequantized_as_gguf_does_and_requantized_within_half_a_step(
    type_name: str, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_k_blocks(type_name, 16, 512), type_name)})
    values = read_one(path)
    expected = oracle(path)["w.weight"]
    assert isinstance(values, np.ndarray) and np.array_equal(values, expected)

    gguf_file = gguf_store.GGUFFile.open(path)
    [(name, record)] = list(_kept_gguf("w.gguf", gguf_file, iter([("w.weight", type_name, values)])))
    bits, group_size = K_BITS[type_name]
    assert (record.dtype, record.group_size) == (f"base_q{bits}", group_size)
    error = np.abs(values_of(record) - expected).reshape(16, -1, group_size).max(axis=-1)  # (rows, groups)
    half_step = record.scales.astype(np.float32) / 2
    # Half a step, plus the rounding of the group's scale and bias to f16.
    assert (error <= half_step * 1.01 + 1e-6).all()


def test_keeping_a_k_quant_file_logs_that_requantizing_compounds_error(tmp_path: Path, caplog) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_k_blocks("Q4_K", 4, 256), "Q4_K")})
    with caplog.at_level(logging.WARNING, logger="baselm.store.convert_gguf"):
        list(_kept_gguf("w.gguf", gguf_store.GGUFFile.open(path), iter([])))
    assert caplog.messages == [
        "w.gguf: K-quant tensors have no exact .base form; requantizing them (Q4_K -> q4) compounds the two rounding "
        "errors"
    ]


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    blocks = np.random.default_rng(0).integers(0, 256, size=(4, 4 * 18), dtype=np.uint8)  # 4 IQ4_NL blocks a row
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (blocks, "IQ4_NL")})
    message = (
        r"w\.gguf: tensor 'w\.weight' is GGUF type IQ4_NL, which base cannot read; base reads F32, F16, BF16, Q4_0"
    )
    with pytest.raises(UnsupportedModelError, match=message):
        gguf_store.GGUFFile.open(path).check_types()
    with pytest.raises(UnsupportedModelError, match=message):
        gguf_store.read_metadata(path)


# ---------------------------------------------------------------------------------------------
# The parser against the gguf package's reader


@pytest.mark.parametrize("name", ["bpe-smollm.gguf", "spm.gguf"])
def test_metadata_and_tensor_bytes_equal_what_gguf_reader_reads(name: str) -> None:
    path = TOKENIZER_FIXTURES / name
    ours = gguf_store.GGUFFile.open(path)
    reader = gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == theirs
    assert [(t.name, t.tensor_type.name) for t in reader.tensors] == [
        (i.name, i.type_name) for i in ours.tensors.values()
    ]
    for tensor in reader.tensors:
        assert np.array_equal(ours.raw(ours.tensors[tensor.name]), tensor.data.reshape(-1).view(np.uint8))


def test_a_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (encode(weights(), "Q8_0"), "Q8_0")})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(gguf_store.ModelFileError, match=r"tensor 'w\.weight' runs past the end of the file"):
        gguf_store.GGUFFile.open(path)


@pytest.mark.parametrize("cut", [3, 8, 40, 200, 1000])
def test_a_gguf_cut_short_or_scrambled_is_a_clear_error(cut: int, tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "w.gguf", {"w.weight": (encode(weights(), "Q4_0"), "Q4_0")}).read_bytes()
    scrambled = source[:cut] + np.random.default_rng(cut).integers(0, 256, 64, dtype=np.uint8).tobytes()
    for data in (source[:cut], scrambled):
        (tmp_path / "bad.gguf").write_bytes(data)
        with pytest.raises(gguf_store.ModelFileError, match=r"bad\.gguf: "):
            gguf_store.GGUFFile.open(tmp_path / "bad.gguf")


# ---------------------------------------------------------------------------------------------
# A whole model: llama q/k rows unpermuted on quantized blocks too


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_a_converted_llama_gguf_holds_its_tensors_exactly_with_qk_rows_in_hf_order(
    type_name: str, tmp_path: Path
) -> None:
    path, config = tiny_llama_gguf(tmp_path / f"llama.{type_name}.gguf", type_name)
    converted = convert(path, tmp_path / "llama.base", None, None, "default")
    assert (converted.arch, converted.quant) == ("llama", "q5")
    header, tensors = read_base_file(tmp_path / "llama.base", verify=True)
    assert header["quant_profile"] == f"gguf-{type_name}"
    expected = oracle(path)
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedArray) and (q.bits, q.group_size) == (5, 32)
    heads = config["num_attention_heads"]
    rows = expected["blk.1.attn_q.weight"]  # (out, in) in llama.cpp's row order
    hf_rows = rows.reshape(heads, -1, 2, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)
    dequantized = mx.dequantize(
        q.codes, q.scales.astype(mx.float32), q.biases.astype(mx.float32), group_size=32, bits=5
    )
    assert same_bits(np.array(dequantized), hf_rows)
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    down_values = mx.dequantize(
        down.codes, down.scales.astype(mx.float32), down.biases.astype(mx.float32), group_size=32, bits=5
    )
    assert same_bits(np.array(down_values), expected["blk.0.ffn_down.weight"])


# ---------------------------------------------------------------------------------------------
# Direct loading (`read_metadata`): the mx.load layout, for every readable type


@pytest.mark.parametrize("type_name", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"])
def test_read_metadata_gives_what_mx_load_gives_for_the_types_mx_load_reads(type_name: str, tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "w.gguf",
        {
            "w.weight": (encode(weights(), type_name), type_name),
            "n.weight": (np.linspace(-1, 1, 128, dtype=np.float32), "F32"),
        },
    )
    ours, _ = gguf_store.read_metadata(path)
    theirs = mx.load(str(path), format="gguf")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and mx.array_equal(ours[name], value), name


def test_read_metadata_gives_q5_triplets_and_k_quants_as_float16(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "w.gguf",
        {
            "a.weight": (encode(weights(), "Q5_1"), "Q5_1"),
            "b.weight": (random_k_blocks("Q6_K", 8, 256), "Q6_K"),
        },
    )
    tensors, _ = gguf_store.read_metadata(path)
    expected = oracle(path)
    assert sorted(tensors) == ["a.biases", "a.scales", "a.weight", "b.weight"]
    a = mx.dequantize(
        tensors["a.weight"],
        tensors["a.scales"].astype(mx.float32),
        tensors["a.biases"].astype(mx.float32),
        group_size=32,
        bits=5,
    )
    assert same_bits(np.array(a), expected["a.weight"])
    assert tensors["b.weight"].dtype == mx.float16
    assert np.array_equal(np.array(tensors["b.weight"]), expected["b.weight"].astype(np.float16))
