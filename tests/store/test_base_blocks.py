"""`.base` block dtypes: GGUF blocks kept byte for byte, the K-quants (`gguf_q4_k`, `gguf_q5_k`,
`gguf_q6_k`) in version-2 files, the legacy types (`gguf_q4_0` ... `gguf_q8_0`) in version-3 ones,
`gguf_q2_k`, `gguf_q3_k`, `gguf_iq4_nl` and `gguf_iq4_xs` in version-4 ones; files without them stay
version 1, byte for byte what they were."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from base_helpers import HEADER_FIELDS, assemble, entry, small_tensors, split_file
from rich.console import Console

from baselm import gguf_blocks
from baselm.store import base_header, base_writer
from baselm.store.base_format import BLOB_ALIGN, MATRIX_ALIGN, PREAMBLE, canonical_json
from baselm.store.base_inspect import inspect_report, render_inspect
from baselm.store.base_reader import BaseFile, BlockArray, model_weights, read_base_file
from baselm.store.base_slices import Cut
from baselm.store.base_writer import TensorRecord, write_base_file
from baselm.store.errors import BaseFileError, SignatureError
from baselm.store.signed_file import keys_with, sign_file, signed_statement, verify_file
from baselm.store.signing import keygen
from tests.tiny_gguf import random_blocks

BLOCKS = "model.layers.0.mlp.up_proj.weight"  # (4, 512): 2 blocks a row
TYPES = [t.gguf_type for t in gguf_blocks.BLOCK_TYPES]  # Q4_0 ... Q8_0, IQ4_NL, Q2_K ... Q6_K, IQ4_XS
VERSION_4 = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
ROWS, COLS = 4, 512


def _record(type_name: str, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> TensorRecord:
    dtype = gguf_blocks.BY_GGUF_TYPE[type_name].dtype
    return TensorRecord.from_blocks(dtype, random_blocks(type_name, rows, cols, seed), (rows, cols))


def _write(path: Path, type_name: str = "Q4_K") -> Path:
    """The small file's float and affine tensors, then one block tensor."""
    return write_base_file(path, [*small_tensors(), (BLOCKS, _record(type_name))], **HEADER_FIELDS)


def _version(path: Path) -> int:
    return PREAMBLE.unpack_from(path.read_bytes())[1]


def _problem(path: Path) -> str:
    with pytest.raises(BaseFileError) as info:
        read_base_file(path)
    return info.value.problem


# ---------------------------------------------------------------------------------------------
# Records and round trips


@pytest.mark.parametrize("type_name", TYPES)
def test_block_tensors_round_trip_byte_for_byte(tmp_path: Path, type_name: str) -> None:
    record = _record(type_name)
    path = _write(tmp_path / "m.base", type_name)
    base = BaseFile.open(path)
    value = base.read(BLOCKS, verify=True)
    block_type = gguf_blocks.BY_GGUF_TYPE[type_name]
    assert isinstance(value, BlockArray)
    assert (value.dtype, value.shape, value.data.dtype) == (block_type.dtype, (ROWS, COLS), mx.uint8)
    assert value.data.shape == (ROWS, COLS // block_type.block_values * block_type.block_bytes)
    assert np.array(value.data).tobytes() == record.data.tobytes()
    want = gguf_blocks.dequantize(block_type.dtype, record.data, (ROWS, COLS))
    assert value.dequantize().dtype == mx.float32
    assert np.array_equal(np.array(value.dequantize()), want)
    assert _version(path) == base.version == (4 if type_name in VERSION_4 else 2 if block_type.is_kquant else 3)
    base.verify()


def test_a_block_entry_has_the_float_entrys_keys_and_a_matrix_region(tmp_path: Path) -> None:
    header, _ = split_file(_write(tmp_path / "m.base", "Q6_K"))
    blocks = entry(header, BLOCKS)
    assert sorted(blocks) == ["checksum_xxh64", "dtype", "length", "name", "offset", "shape"]
    assert (blocks["dtype"], blocks["shape"], blocks["length"]) == ("gguf_q6_k", [ROWS, COLS], ROWS * 2 * 210)
    assert blocks["offset"] == 4 * MATRIX_ALIGN  # after the small file's last matrix, at the next 16 KiB
    assert header["schema"] == "base.v1"  # the header's keys are the same; the preamble's version says blocks


def test_model_weights_name_blocks_by_their_suffix(tmp_path: Path) -> None:
    tensors = BaseFile.open(_write(tmp_path / "m.base", "Q5_K")).load()
    weights, group_sizes = model_weights(tensors)
    prefix = BLOCKS.removesuffix(".weight")
    assert f"{prefix}.q5_k" in weights and BLOCKS not in weights and prefix not in group_sizes
    assert weights[f"{prefix}.q5_k"].dtype == mx.uint8 and weights[f"{prefix}.q5_k"].shape == (ROWS, 2 * 176)
    assert gguf_blocks.split_name(f"{prefix}.q5_k") == (prefix, gguf_blocks.BY_SUFFIX["q5_k"])


def test_from_blocks_takes_flat_bytes_and_keeps_them_uncopied() -> None:
    raw = random_blocks("Q4_K", ROWS, COLS).reshape(-1)  # (rows * row_bytes,)
    record = TensorRecord.from_blocks("gguf_q4_k", raw, (ROWS, COLS))
    assert record.data.shape == (ROWS, 288) and np.shares_memory(record.data, raw)
    assert (record.bits, record.block_type, record.buffers()) == (
        None,
        gguf_blocks.BY_DTYPE["gguf_q4_k"],
        [record.data],
    )


@pytest.mark.parametrize(
    ("dtype", "data", "shape", "problem"),
    [
        ("gguf_iq2_xs", np.zeros((4, 148), np.uint8), (4, 512), "'gguf_iq2_xs' is not a block dtype"),
        ("gguf_q4_k", np.zeros(288, np.uint8), (288 * 8,), "a gguf_q4_k tensor is a matrix"),
        ("gguf_q4_k", np.zeros((4, 216), np.uint8), (4, 384), "gguf_q4_k rows hold whole blocks of 256 values"),
        ("gguf_q8_0", np.zeros((4, 51), np.uint8), (4, 48), "gguf_q8_0 rows hold whole blocks of 32 values"),
        ("gguf_q4_k", np.zeros((4, 288), np.int32), (4, 512), "gguf_q4_k blocks are uint8 bytes, not int32"),
        ("gguf_q4_k", np.zeros((4, 287), np.uint8), (4, 512), r"are not a matrix of shape \[4, 512\]"),
        ("gguf_q4_k", np.zeros((8, 144), np.uint8), (4, 512), r"blocks of shape \[8, 144\] are not a matrix"),
    ],
)
def test_from_blocks_refuses_what_is_not_whole_rows_of_blocks(dtype, data, shape, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        TensorRecord.from_blocks(dtype, data, shape)


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (
            TensorRecord("gguf_q4_k", (4, 512), data=np.zeros((4, 287), np.uint8)),
            r"array sizes \[1148\] do not match gguf_q4_k \[4, 512\]",
        ),
        (
            TensorRecord("gguf_q4_k", (4, 384), data=np.zeros((4, 216), np.uint8)),
            "gguf_q4_k tensors are 2-D uint8 blocks with in_features % 256 == 0",
        ),
        (
            TensorRecord("gguf_q6_k", (2048,), data=np.zeros(1680, np.uint8)),
            "gguf_q6_k tensors are 2-D uint8 blocks",
        ),
        (
            TensorRecord("gguf_q5_0", (4, 48), data=np.zeros((4, 33), np.uint8)),
            "gguf_q5_0 tensors are 2-D uint8 blocks with in_features % 32 == 0",
        ),
    ],
)
def test_the_writer_refuses_a_block_record_its_arrays_contradict(tmp_path: Path, record, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        write_base_file(tmp_path / "m.base", [(BLOCKS, record)], **HEADER_FIELDS)
    assert not (tmp_path / "m.base").exists()


# ---------------------------------------------------------------------------------------------
# Versions


def _exact_tensors() -> list[tuple[str, TensorRecord | np.ndarray | mx.array]]:
    """Float and affine tensors of exact values (no float maths), so their bytes are the same on every machine."""
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 2**32, size=(8, 16), dtype=np.uint32)  # (out, in * 4 / 32): q4 of (8, 128)
    scales = (rng.integers(1, 100, size=(8, 2)) / 1024).astype(np.float16)  # (out, in / 64)
    biases = (rng.integers(-100, 100, size=(8, 2)) / 1024).astype(np.float16)
    return [
        ("model.layers.0.self_attn.q_proj.weight", TensorRecord.from_triplet(codes, scales, biases, 64)),
        ("model.layers.0.input_layernorm.weight", (rng.integers(-64, 64, 64) / 16).astype(np.float32)),
        ("model.norm.weight", mx.array(rng.integers(-64, 64, 64) / 16).astype(mx.bfloat16)),
        ("model.extra.weight", (rng.integers(-64, 64, (3, 5)) / 16).astype(np.float16)),
    ]


def test_a_file_without_blocks_is_version_1_byte_for_byte_as_before(tmp_path: Path) -> None:
    path = write_base_file(tmp_path / "m.base", _exact_tensors(), **HEADER_FIELDS)
    assert _version(path) == BaseFile.open(path).version == 1
    # xxh64 of these bytes as the writer made them before block dtypes existed
    assert (xxhash.xxh64(path.read_bytes()).hexdigest(), path.stat().st_size) == ("bf1564dde18712d2", 81950)


def test_a_file_with_blocks_is_version_2_and_otherwise_the_same_layout(tmp_path: Path) -> None:
    plain, plain_blob = split_file(write_base_file(tmp_path / "a.base", small_tensors(), **HEADER_FIELDS))
    blocks, blocks_blob = split_file(_write(tmp_path / "b.base"))
    assert (_version(tmp_path / "a.base"), _version(tmp_path / "b.base")) == (1, 2)
    assert blocks["tensors"][:-1] == plain["tensors"] and blocks_blob.startswith(plain_blob)


def test_a_file_with_legacy_blocks_is_version_3_with_k_quant_blocks_or_without(tmp_path: Path) -> None:
    legacy = _write(tmp_path / "a.base", "Q8_0")
    both = [*small_tensors(), (BLOCKS, _record("Q5_0")), ("model.layers.0.mlp.gate_proj.weight", _record("Q6_K"))]
    mixed = write_base_file(tmp_path / "b.base", both, **HEADER_FIELDS)
    assert (_version(legacy), _version(mixed)) == (3, 3)
    tensors = BaseFile.open(mixed).load(verify=True)
    assert (tensors[BLOCKS].dtype, tensors["model.layers.0.mlp.gate_proj.weight"].dtype) == ("gguf_q5_0", "gguf_q6_k")


@pytest.mark.parametrize("type_name", VERSION_4)
def test_a_file_with_q2_k_q3_k_or_iq4_blocks_is_version_4_with_other_blocks_or_without(
    tmp_path: Path, type_name: str
) -> None:
    alone = _write(tmp_path / "a.base", type_name)
    both = [*small_tensors(), (BLOCKS, _record(type_name)), ("model.layers.0.mlp.gate_proj.weight", _record("Q8_0"))]
    mixed = write_base_file(tmp_path / "b.base", both, **HEADER_FIELDS)
    assert (_version(alone), _version(mixed)) == (4, 4)
    dtype = gguf_blocks.BY_GGUF_TYPE[type_name].dtype
    assert BaseFile.open(mixed).load(verify=True)[BLOCKS].dtype == dtype


@pytest.mark.parametrize(
    ("type_name", "versions", "read"),
    [
        ("Q4_K", (1,), "version 1"),
        ("Q8_0", (1, 2), "versions 1 and 2"),
        *((name, (1, 2, 3), "versions 1, 2 and 3") for name in VERSION_4),
    ],
)
def test_a_build_that_knows_no_such_blocks_refuses_the_file_by_its_version(
    tmp_path: Path, monkeypatch, type_name: str, versions: tuple[int, ...], read: str
) -> None:
    path = _write(tmp_path / "m.base", type_name)
    monkeypatch.setattr(base_header, "VERSIONS", versions)  # what a build from before these block dtypes reads
    version = gguf_blocks.BY_GGUF_TYPE[type_name].base_version
    assert (
        _problem(path)
        == f"its version is {version}, and this build reads {read}; a newer base wrote it, so upgrade base to read it"
    )


def test_a_rewritten_header_keeps_version_2(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.base")
    base = BaseFile.open(path)
    header = {k: v for k, v in base.header.items() if k != "header_xxh64"} | {"flags": ["tied_embeddings", "x"]}
    with open(path, "r+b") as f:
        base_writer.rewrite_header(f, header, base.blob_start, path.stat().st_size - base.blob_start)
    assert _version(path) == 2 and BaseFile.open(path).header["flags"] == ["tied_embeddings", "x"]
    BaseFile.open(path).verify()


def test_an_embedded_signature_keeps_version_2_and_covers_the_blocks(tmp_path: Path) -> None:
    key, pub = keygen(tmp_path / "keys", "alice")
    path = _write(tmp_path / "m.base")
    sign_file(path, key, embed=True)
    assert _version(path) == 2
    verify_file(path, keys_with(pub))
    base = BaseFile.open(path)
    digests = signed_statement(base, keys_with(pub))[0]["tensors_sha256"]
    position = base.blob_start + base.tensors[BLOCKS].offset + 5
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SignatureError, match=f"tensor {BLOCKS!r} differs from the one that was signed"):
        BaseFile.open(path).load(digests=digests)


# ---------------------------------------------------------------------------------------------
# Header checks


def _set(**fields):
    return lambda h: entry(h, BLOCKS).update(fields)


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (
            _set(length=ROWS * 288 - 1),
            f"tensor {BLOCKS!r} has length {ROWS * 288 - 1}, but gguf_q4_k [4, 512] takes {ROWS * 288} bytes",
        ),
        (
            _set(shape=[6, 384], length=6 * 216),  # the length of 1.5 blocks a row, had they existed
            f"tensor {BLOCKS!r} has 384 input features, not a multiple of the 256 values of a gguf_q4_k block",
        ),
        (_set(shape=[ROWS * COLS]), f"tensor {BLOCKS!r} holds gguf_q4_k blocks but has 1 dimensions, not 2"),
        (_set(shape=[2, 2, COLS]), f"tensor {BLOCKS!r} holds gguf_q4_k blocks but has 3 dimensions, not 2"),
        (
            _set(dtype="gguf_q5_k"),
            f"tensor {BLOCKS!r} has length {ROWS * 288}, but gguf_q5_k [4, 512] takes {ROWS * 352} bytes",
        ),
        (_set(group_size=32), f"tensor {BLOCKS!r} (gguf_q4_k) has missing or unexpected keys: group_size"),
        (
            _set(offset=4 * MATRIX_ALIGN + 64),
            f"tensor {BLOCKS!r} starts at blob offset {4 * MATRIX_ALIGN + 64}, not a multiple of {MATRIX_ALIGN}",
        ),
    ],
)
def test_block_entries_are_checked(tmp_path: Path, mutate, problem: str) -> None:
    header, blob = split_file(_write(tmp_path / "m.base"))
    mutate(header)
    assert _problem(assemble(tmp_path / "m.base", canonical_json(header), blob, version=2)) == problem


@pytest.mark.parametrize(
    ("type_name", "version"), [("Q4_K", 1), ("Q4_0", 1), ("Q4_0", 2), ("Q3_K", 3), ("Q2_K", 2), ("IQ4_NL", 3)]
)
def test_a_block_dtype_in_a_file_of_an_earlier_version_is_an_error(
    tmp_path: Path, type_name: str, version: int
) -> None:
    header, blob = split_file(_write(tmp_path / "m.base", type_name))
    path = assemble(tmp_path / "m.base", canonical_json(header), blob, version=version)
    block_type = gguf_blocks.BY_GGUF_TYPE[type_name]
    assert _problem(path) == (
        f"tensor {BLOCKS!r} has block dtype {block_type.dtype}, which needs a version-{block_type.base_version} file, "
        f"but the file is version {version}"
    )


def test_legacy_block_entries_are_checked_against_their_32_value_blocks(tmp_path: Path) -> None:
    header, blob = split_file(_write(tmp_path / "m.base", "Q8_0"))
    entry(header, BLOCKS).update(shape=[ROWS, 48], length=ROWS * 51)  # 1.5 blocks a row
    assert _problem(assemble(tmp_path / "m.base", canonical_json(header), blob, version=3)) == (
        f"tensor {BLOCKS!r} has 48 input features, not a multiple of the 32 values of a gguf_q8_0 block"
    )


def test_a_flipped_block_byte_fails_verification_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.base")
    offset = entry(split_file(path)[0], BLOCKS)["offset"]
    data = bytearray(path.read_bytes())
    data[BLOB_ALIGN + offset + 300] ^= 0x01  # second row, first block
    path.write_bytes(bytes(data))
    base = BaseFile.open(path)
    assert np.array(base.read(BLOCKS).data)[1, 12] == data[BLOB_ALIGN + offset + 300]
    with pytest.raises(BaseFileError, match=f"tensor {BLOCKS!r} fails its checksum"):
        base.verify()
    with pytest.raises(BaseFileError, match="fails its checksum"):
        base.read(BLOCKS, verify=True)


# ---------------------------------------------------------------------------------------------
# Cuts


@pytest.mark.parametrize(
    ("axis", "ranges", "want"),
    [
        (-2, [(1, 3)], lambda raw: raw[1:3]),
        (-2, [(0, 1), (3, 4)], lambda raw: raw[[0, 3]]),  # a fused tensor's row ranges
        (-1, [(256, 512)], lambda raw: raw[:, 210:]),  # the second block of each row
        (-1, [(256, 512), (0, 256)], lambda raw: np.concatenate([raw[:, 210:], raw[:, :210]], axis=1)),
    ],
)
def test_cuts_read_whole_rows_and_whole_blocks(tmp_path: Path, axis: int, ranges, want) -> None:
    raw = _record("Q6_K").data  # (4, 2 * 210)
    base = BaseFile.open(_write(tmp_path / "m.base", "Q6_K"))
    got = base.load(cuts={BLOCKS: [Cut(axis, a, b) for a, b in ranges]}, skip=set(base.tensors) - {BLOCKS})[BLOCKS]
    shape = [ROWS, COLS]
    shape[axis] = sum(b - a for a, b in ranges)
    assert isinstance(got, BlockArray) and (got.dtype, got.shape) == ("gguf_q6_k", tuple(shape))
    assert np.array_equal(np.array(got.data), want(raw))
    assert base.bytes_read == want(raw).nbytes  # the cuts' bytes alone


@pytest.mark.parametrize("cut", [Cut(-1, 0, 128), Cut(-1, 128, 512), Cut(-1, 0, 300), Cut(-2, 2, 5)])
def test_cuts_off_whole_blocks_are_refused(tmp_path: Path, cut: Cut) -> None:
    base = BaseFile.open(_write(tmp_path / "m.base"))
    with pytest.raises(ValueError, match=r"do not fit its shape \(4, 512\) and gguf_q4_k's blocks of 256 values"):
        base.load(cuts={BLOCKS: [cut]})


def test_cuts_of_legacy_blocks_read_whole_32_value_blocks(tmp_path: Path) -> None:
    raw = _record("Q5_1").data  # (4, 16 * 24)
    base = BaseFile.open(_write(tmp_path / "m.base", "Q5_1"))
    got = base.load(cuts={BLOCKS: [Cut(-1, 96, 160)]}, skip=set(base.tensors) - {BLOCKS})[BLOCKS]
    assert (got.dtype, got.shape) == ("gguf_q5_1", (ROWS, 64))
    assert np.array_equal(np.array(got.data), raw[:, 3 * 24 : 5 * 24])  # blocks 3 and 4 of each row
    with pytest.raises(ValueError, match=r"and gguf_q5_1's blocks of 32 values"):
        base.load(cuts={BLOCKS: [Cut(-1, 96, 144)]})


# ---------------------------------------------------------------------------------------------
# Inspect


@pytest.mark.parametrize(
    ("type_name", "bits"),
    [("Q4_0", 4.5), ("Q4_1", 5.0), ("Q5_0", 5.5), ("Q5_1", 6.0), ("Q8_0", 8.5), ("Q4_K", 4.5), ("Q5_K", 5.5),
     ("Q6_K", 6.5625)],
)  # fmt: skip
def test_inspect_shows_the_block_dtype_and_its_bits_per_weight(tmp_path: Path, type_name: str, bits: float) -> None:
    report = inspect_report(_write(tmp_path / "m.base", type_name), verify=True)
    dtype = gguf_blocks.BY_GGUF_TYPE[type_name].dtype
    row = next(row for row in report["tensors"] if row["name"] == BLOCKS)
    assert row == {
        "name": BLOCKS,
        "dtype": dtype,
        "shape": [ROWS, COLS],
        "group_size": None,
        "bytes": ROWS * COLS * bits / 8,
        "bits_per_weight": bits,
    }
    console = Console(record=True, width=200)
    render_inspect(report, console)
    line = next(line for line in console.export_text().splitlines() if BLOCKS in line)
    assert dtype in line and "4x512" in line and f" {bits:g} " in line
