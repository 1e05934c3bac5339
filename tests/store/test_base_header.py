"""The `.base` reader's validation: every malformed preamble, header, entry, layout and checksum is a clear error."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from base_helpers import NORM_NAME, Q_NAME, assemble, entry, rewrite_header, split_file, write_small

from baselm.store.base_format import BLOB_ALIGN, MATRIX_ALIGN, MAX_HEADER_LEN, canonical_json
from baselm.store.base_reader import BaseFile, read_base_file
from baselm.store.errors import BaseFileError, ModelFileError


def _problem(path: Path, verify: bool = False) -> str:
    with pytest.raises(BaseFileError) as info:
        read_base_file(path, verify=verify)
    assert str(path) in str(info.value)
    return info.value.problem


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


@pytest.mark.parametrize(
    ("version", "problem"),
    [
        (
            5,
            "its version is 5, and this build reads versions 1, 2, 3 and 4; a newer base wrote it, so upgrade base "
            "to read it",
        ),
        (0, "its version is 0, and this build reads versions 1, 2, 3 and 4"),
    ],
)
def test_other_version(tmp_path: Path, version: int, problem: str) -> None:
    header, blob = split_file(write_small(tmp_path / "m.base"))
    path = assemble(tmp_path / "m.base", canonical_json(header), blob, version=version)
    assert _problem(path) == problem


def test_a_version_2_file_without_blocks_reads(tmp_path: Path) -> None:
    header, blob = split_file(write_small(tmp_path / "m.base"))
    path = assemble(tmp_path / "m.base", canonical_json(header), blob, version=2)
    assert BaseFile.open(path).version == 2 and len(read_base_file(path)[1]) == 7


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
            "its header is not valid JSON (maximum recursion depth exceeded while decoding a JSON array from a "
            "unicode string)",
        ),
        (b"[1, 2]", "its header is a JSON list, not an object"),
        (
            b'{"a": ' + b"9" * 5000 + b"}",
            "its header is not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
            "5000 digits; use sys.set_int_max_str_digits() to increase the limit)",
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
            "its alignment {'blob': 65536, 'matrix': 4096, 'vector': 64} differs from the v1 rule {'blob': 65536, "
            "'matrix': 16384, 'vector': 64}",
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
            f"tensor {NORM_NAME!r} has dtype 'f64'; expected one of f32, f16, bf16, base_q2, base_q3, base_q4, "
            "base_q5, base_q6, base_q8, gguf_q4_0, gguf_q4_1, gguf_q5_0, gguf_q5_1, gguf_q8_0, gguf_iq4_nl, gguf_q2_k, "
            "gguf_q3_k, gguf_q4_k, gguf_q5_k, gguf_q6_k, gguf_iq4_xs",
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
            f"tensor {Q_NAME!r} has scale_offset 520 and bias_offset 544, expected 512 and 544 (codes, scales, biases "
            "back to back)",
        ),
        (_set(NORM_NAME, offset=600), f"tensor {NORM_NAME!r} starts at blob offset 600, not a multiple of 64"),
        (
            _set("model.extra.weight", offset=MATRIX_ALIGN + 64),
            "tensor 'model.extra.weight' starts at blob offset 16448, not a multiple of 16384",
        ),
        (
            _set("model.extra.weight", offset=4 * MATRIX_ALIGN),
            f"tensor 'model.extra.weight' ends at blob offset {4 * MATRIX_ALIGN + 30}, past the blob end "
            f"{3 * MATRIX_ALIGN + 30}",
        ),
        (_set(NORM_NAME, offset=512), f"tensors {Q_NAME!r} and {NORM_NAME!r} overlap in the blob"),
    ],
)
def test_tensor_entries_are_checked(tmp_path: Path, mutate, problem: str) -> None:
    assert _problem(rewrite_header(write_small(tmp_path / "m.base"), mutate)) == problem


def test_truncated_blob(tmp_path: Path) -> None:
    path = write_small(tmp_path / "m.base")
    path.write_bytes(path.read_bytes()[:-1])
    end, blob_end = 3 * MATRIX_ALIGN + 30, 3 * MATRIX_ALIGN + 29
    assert _problem(path) == f"tensor 'model.extra.weight' ends at blob offset {end}, past the blob end {blob_end}"


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
