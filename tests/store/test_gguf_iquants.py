"""GGUF IQ4_NL and IQ4_XS as `.base` records: exact `base_q8` triplets (codes level + 128 over each
block's scale) where no block kernel runs them, the blocks byte for byte in a pull.

The oracle is the `gguf` package's dequantizer; the blocks are random bytes (tests/tiny_gguf.py
`random_blocks`) with sane float16 scales, which it reads like any other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from baselm.store import gguf as gguf_store
from baselm.store import gguf_kquants
from tests.tiny_gguf import oracle, random_blocks, same_bits, values_of, write_gguf

IQ4 = ("IQ4_NL", "IQ4_XS")


def read_one(path: Path):
    gguf_file = gguf_store.GGUFFile.open(path)
    return gguf_file.read(gguf_file.tensors["w.weight"])


@pytest.mark.parametrize("type_name", IQ4)
@pytest.mark.parametrize("seed", [0, 1])
def test_an_iq4_tensor_dequantizes_bit_for_bit_as_gguf_does(type_name: str, seed: int, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 16, 512, seed), type_name)})
    record = read_one(path)
    assert (record.dtype, record.group_size, record.shape) == ("base_q8", 32, (16, 512))
    assert same_bits(values_of(record), oracle(path)["w.weight"])


@pytest.mark.parametrize("type_name", IQ4)
def test_negative_scales_and_every_level_are_exact(type_name: str, tmp_path: Path) -> None:
    """d of either sign, every nibble 0-15 (IQ4_XS: every 6-bit block scale, ls - 32 from -32 to 31)."""
    raw = random_blocks(type_name, 8, 512, seed=2).reshape(8, -1, 18 if type_name == "IQ4_NL" else 136)
    raw[::2, :, 1] ^= 0x80  # the sign bit of d in every other row
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (raw.reshape(8, -1), type_name)})
    expected = oracle(path)["w.weight"]
    assert (expected < 0).any() and (expected > 0).any()
    assert same_bits(values_of(read_one(path)), expected)


def test_iq4_nl_scales_are_float16_and_iq4_xs_scales_float32_when_a_product_needs_more_bits(tmp_path: Path) -> None:
    nl = write_gguf(tmp_path / "nl.gguf", {"w.weight": (random_blocks("IQ4_NL", 4, 256), "IQ4_NL")})
    xs = write_gguf(tmp_path / "xs.gguf", {"w.weight": (random_blocks("IQ4_XS", 4, 256), "IQ4_XS")})
    assert (read_one(nl).scale_dtype, read_one(xs).scale_dtype) == ("f16", "f32")  # d * (ls - 32): up to 17 bits


@pytest.mark.parametrize("type_name", IQ4)
def test_a_large_iq4_tensor_decoded_in_chunks_of_rows_gives_the_same_record(
    type_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "w.gguf", {"w.weight": (random_blocks(type_name, 10, 512), type_name)})
    whole = read_one(path)
    monkeypatch.setattr(gguf_kquants, "CHUNK_VALUES", 3 * 512)  # chunks of 3 rows: 3 + 3 + 3 + 1
    chunked = read_one(path)
    for part in ("codes", "scales", "biases"):
        assert np.array_equal(getattr(chunked, part), getattr(whole, part)), part
