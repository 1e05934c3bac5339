"""GGUF tensors as `.base` tensors: exact for F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (the legacy
types as affine triplets, or kept as their blocks), refused by name for types base cannot read
(K-quants: test_gguf_kquants.py).

Every file here is written with the `gguf` package's GGUFWriter; the oracle for the values is
the same package's reader and `gguf.quants.dequantize`.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm import gguf_blocks
from baselm.store import gguf as gguf_store
from baselm.store import gguf_affine
from baselm.store.base_reader import BlockArray, read_base_file
from baselm.store.base_writer import TensorRecord
from baselm.store.convert import convert
from baselm.store.errors import UnsupportedModelError
from baselm.store.quantize import pack_codes
from tests.paths import TOKENIZER_FIXTURES
from tests.tiny_gguf import encode, oracle, random_blocks, same_bits, tiny_llama_gguf, values_of, write_gguf

EXACT = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


def weights(rows: int = 64, cols: int = 128, seed: int = 0) -> np.ndarray:
    """Values of every scale: normal rows, a tiny row (subnormal f16 block scales), a zero row."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)  # (rows, cols)
    w[1] *= 1e-6
    w[2] = 0
    return w


def read_one(path: Path, name: str = "w.weight") -> TensorRecord:
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
    packed = pack_codes(codes, bits)  # (out, in * bits / 32)
    assert np.array_equal(packed, _pack_bit_by_bit(codes, bits))
    ones, zeros = mx.ones((4, 128 // 32)), mx.zeros((4, 128 // 32))
    unpacked = mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), codes.astype(np.float32))
    # And MLX's own quantizer's codes read back through the same layout.
    w = mx.random.normal((4, 128), key=mx.random.key(bits))
    mlx_codes, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    assert np.array_equal(np.array(mlx_codes), pack_codes(_unpack(np.array(mlx_codes), bits), bits))


def _pack_bit_by_bit(codes: np.ndarray, bits: int) -> np.ndarray:
    """The reference: each row's values as one little-endian bit stream, value i at bit i * bits."""
    stream = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)  # (out, in, bits)
    packed = np.packbits(stream.reshape(codes.shape[0], -1), axis=-1, bitorder="little")
    return packed.view("<u4")


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    stream = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")  # (out, in * bits)
    stream = stream.reshape(packed.shape[0], -1, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1).astype(np.uint8)


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    blocks = np.random.default_rng(0).integers(0, 256, size=(4, 2 * 66), dtype=np.uint8)  # 2 IQ2_XXS blocks a row
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (blocks, "IQ2_XXS")})
    message = (
        r"w\.gguf: tensor 'w\.weight' is GGUF type IQ2_XXS, which base cannot read; base reads F32, F16, BF16, Q4_0"
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


def gguf_bytes(metadata: list[bytes] = (), tensors: list[bytes] = ()) -> bytes:
    """A GGUF file made by hand: version 3, the given metadata pairs and tensor table entries, no data."""
    return b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + b"".join(metadata) + b"".join(tensors)


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def nested_array(depth: int) -> bytes:
    """A metadata pair whose value is `depth` arrays, one inside the other, around one uint32 (GGUF types 9, 4)."""
    value = struct.pack("<IQI", 4, 1, 7)  # the innermost array: one uint32
    for _ in range(depth - 1):
        value = struct.pack("<IQ", 9, 1) + value
    return gguf_string("deep") + struct.pack("<I", 9) + value


@pytest.mark.parametrize("dims", [[2**32, 2**32], [2**62, 8], [2**63, 2**63, 2]])
def test_a_tensor_whose_size_wraps_64_bits_is_refused_as_larger_than_the_file(dims: list[int], tmp_path: Path) -> None:
    entry = gguf_string("w.weight") + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, 0)  # F32 at offset 0
    path = tmp_path / "huge.gguf"
    path.write_bytes(gguf_bytes(tensors=[entry]) + bytes(64))
    with pytest.raises(gguf_store.ModelFileError, match=r"huge\.gguf: tensor 'w\.weight' .* more than the file"):
        gguf_store.GGUFFile.open(path)


def test_metadata_arrays_nest_at_most_8_deep(tmp_path: Path) -> None:
    path = tmp_path / "deep.gguf"
    path.write_bytes(gguf_bytes([nested_array(8)]))
    assert gguf_store.GGUFFile.open(path).metadata == {"deep": [[[[[[[[7]]]]]]]]}
    for depth in (9, 5000):  # 5000: past Python's recursion limit
        path.write_bytes(gguf_bytes([nested_array(depth)]))
        with pytest.raises(gguf_store.ModelFileError, match=r"deep\.gguf: .*arrays nested more than 8 deep"):
            gguf_store.GGUFFile.open(path)


# ---------------------------------------------------------------------------------------------
# A whole model: llama q/k rows unpermuted on quantized blocks too


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_a_converted_llama_gguf_holds_its_blocks_byte_for_byte_with_qk_rows_in_hf_order(
    type_name: str, tmp_path: Path
) -> None:
    path, config = tiny_llama_gguf(tmp_path / f"llama.{type_name}.gguf", type_name)
    converted = convert(path, tmp_path / "llama.base", None, None, "default")
    assert (converted.arch, converted.quant) == ("llama", "q5")
    header, tensors = read_base_file(tmp_path / "llama.base", verify=True)
    assert header["quant_profile"] == f"gguf-{type_name}"
    expected = oracle(path)
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, BlockArray) and q.dtype == f"gguf_{type_name.lower()}"
    heads = config["num_attention_heads"]

    def in_hf_order(rows: np.ndarray) -> np.ndarray:  # llama.cpp's RoPE row order undone
        return rows.reshape(heads, -1, 2, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)

    assert np.array_equal(np.array(q.data), in_hf_order(raw["blk.1.attn_q.weight"]))  # whole rows of blocks moved
    assert same_bits(np.array(q.dequantize()), in_hf_order(expected["blk.1.attn_q.weight"]))
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert np.array_equal(np.array(down.data), raw["blk.0.ffn_down.weight"])
    assert same_bits(np.array(down.dequantize()), expected["blk.0.ffn_down.weight"])


@pytest.mark.parametrize("type_name", list(BITS))
def test_a_legacy_tensor_kept_as_blocks_is_its_bytes_and_converts_to_the_exact_triplet(
    type_name: str, tmp_path: Path
) -> None:
    """Read with its blocks kept, a tensor is a view of the file's bytes; `blocks_as_triplets` (the
    paths that run no block kernel) turns them into the triplet a read without blocks gives."""
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 8, 96, seed=3), type_name)})
    gguf_file = gguf_store.GGUFFile.open(path)
    kept = gguf_file.read(gguf_file.tensors["w.weight"], keep_blocks=frozenset({type_name}))
    assert (kept.dtype, kept.shape, kept.bits) == (f"gguf_{type_name.lower()}", (8, 96), None)
    assert np.shares_memory(kept.data, gguf_file.raw(gguf_file.tensors["w.weight"]))
    assert same_bits(gguf_blocks.dequantize(kept.dtype, kept.data, kept.shape), oracle(path)["w.weight"])
    weights = gguf_affine.record_arrays("w.weight", kept)
    assert list(weights) == [f"w.{type_name.lower()}"]
    gguf_affine.blocks_as_triplets(weights, keep=frozenset(set(BITS) - {type_name}))
    expected = gguf_affine.record_arrays("w.weight", read_one(path))
    assert sorted(weights) == sorted(expected) == ["w.biases", "w.scales", "w.weight"]
    assert all(mx.array_equal(weights[name], expected[name]).item() for name in expected)


def test_blocks_as_triplets_leaves_the_kept_types_as_they_are(tmp_path: Path) -> None:
    blocks = mx.array(random_blocks("Q8_0", 4, 64))
    weights = {"a.q8_0": blocks, "b.q4_0": mx.array(random_blocks("Q4_0", 4, 64)), "c.weight": mx.zeros((2,))}
    gguf_affine.blocks_as_triplets(weights, keep=frozenset({"Q8_0"}))
    assert sorted(weights) == ["a.q8_0", "b.biases", "b.scales", "b.weight", "c.weight"]
    assert weights["a.q8_0"] is blocks


def test_a_ggufs_recommended_sampling_is_kept_in_hf_generation_config_names(tmp_path: Path) -> None:
    def sampling(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("general.sampling.temp", 0.6)
        writer.add_uint32("general.sampling.top_k", 20)
        writer.add_float32("general.sampling.top_p", 0.95)
        writer.add_float32("general.sampling.penalty_repeat", 1.05)
        writer.add_string("general.sampling.sequence", "penalties;top_k;top_p;temp")  # not a value: left out

    path, _ = tiny_llama_gguf(tmp_path / "llama.gguf", "Q8_0", more=sampling)
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}  # float32's 7 digits
    assert gguf_store.GGUFCheckpoint.open(path).config["generation_config"] == expected
    convert(path, tmp_path / "llama.base", None, None, "default")
    header, _ = read_base_file(tmp_path / "llama.base")
    assert header["config"]["generation_config"] == expected  # the store keeps them


def test_a_gguf_without_sampling_keys_has_no_generation_config(tmp_path: Path) -> None:
    path, _ = tiny_llama_gguf(tmp_path / "llama.gguf", "Q8_0")
    assert "generation_config" not in gguf_store.GGUFCheckpoint.open(path).config


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


def test_read_metadata_gives_q5_and_k_quant_triplets_that_dequantize_as_gguf_does(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "w.gguf",
        {
            "a.weight": (encode(weights(), "Q5_1"), "Q5_1"),
            "b.weight": (random_blocks("Q5_K", 8, 256), "Q5_K"),
        },
    )
    tensors, _ = gguf_store.read_metadata(path)
    expected = oracle(path)
    assert sorted(tensors) == ["a.biases", "a.scales", "a.weight", "b.biases", "b.scales", "b.weight"]
    for prefix in ("a", "b"):
        values = mx.dequantize(
            tensors[f"{prefix}.weight"],
            tensors[f"{prefix}.scales"].astype(mx.float32),
            tensors[f"{prefix}.biases"].astype(mx.float32),
            group_size=32,
            bits=5,
        )
        assert same_bits(np.array(values), expected[f"{prefix}.weight"])
