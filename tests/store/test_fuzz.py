"""Fuzzing the `.base` reader: every damaged file loads exactly as written or fails with BaseFileError.

A small real file (quantized and float tensors) is damaged in many deterministic ways: flipped
bits in the preamble, header, padding and blob; truncation at every region boundary and at
random points; wrong header lengths; broken JSON; offsets past the end, overlapping regions and
other inconsistent tensor entries. Each damaged file is read with and without `verify`:

- any exception other than BaseFileError fails the test;
- a verified load must return the original header and bit-identical tensors;
- a flipped byte inside a tensor region must be caught by the verified load.
"""

from __future__ import annotations

import copy
import random
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from base_helpers import assemble, split_file, write_small

from baselm.store.base_format import BLOB_ALIGN, DTYPES, PREAMBLE, canonical_json
from baselm.store.base_reader import QuantizedArray, read_base_file
from baselm.store.errors import BaseFileError

SEED = 20261129


def _raw(value: mx.array | QuantizedArray) -> list[bytes]:
    """Bytes of a loaded tensor (every array of a triplet), for bit-exact comparison."""
    arrays = [value.codes, value.scales, value.biases] if isinstance(value, QuantizedArray) else [value]
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in arrays]


class Oracle:
    """The original file, and the judge of one damaged copy."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = path.read_bytes()
        self.header, tensors = read_base_file(path, verify=True)
        self.tensors = {name: (_shape(v), _raw(v)) for name, v in tensors.items()}
        self.header_len = struct.unpack_from("<Q", self.data, 8)[0]
        self.num_cases = self.num_rejected = 0

    def judge(self, damaged: bytes, label: str) -> str:
        """'equal' when the verified load equals the original, 'rejected' when it raised BaseFileError."""
        self.num_cases += 1
        target = self.path.with_name("damaged.base")
        target.write_bytes(damaged)
        try:
            read_base_file(target, verify=False)  # may load changed data, but must not crash
        except BaseFileError:
            pass
        try:
            header, tensors = read_base_file(target, verify=True)
        except BaseFileError:
            self.num_rejected += 1
            return "rejected"
        assert header == self.header, label
        assert {n: (_shape(v), _raw(v)) for n, v in tensors.items()} == self.tensors, label
        return "equal"


def _shape(value: mx.array | QuantizedArray) -> tuple[int, ...]:
    return tuple(value.shape)


def _flip(data: bytes, position: int, rng: random.Random) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 1 << rng.randrange(8)
    return bytes(damaged)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    return Oracle(write_small(tmp_path_factory.mktemp("fuzz") / "small.base"))


def _regions(oracle: Oracle) -> list[tuple[int, int]]:
    return [(BLOB_ALIGN + t["offset"], BLOB_ALIGN + t["offset"] + t["length"]) for t in oracle.header["tensors"]]


def test_flipped_bits_in_preamble_and_header(oracle: Oracle) -> None:
    rng = random.Random(SEED)
    end = PREAMBLE.size + oracle.header_len
    positions = list(range(PREAMBLE.size)) + [rng.randrange(PREAMBLE.size, end) for _ in range(200)]
    for position in positions:
        oracle.judge(_flip(oracle.data, position, rng), f"header bit flip at {position}")


def test_flipped_bits_in_padding_are_rejected(oracle: Oracle) -> None:
    rng = random.Random(SEED + 1)
    for _ in range(20):
        position = rng.randrange(PREAMBLE.size + oracle.header_len, BLOB_ALIGN)
        assert oracle.judge(_flip(oracle.data, position, rng), f"padding flip at {position}") == "rejected"


def test_flipped_bits_in_the_blob_are_caught_by_verify(oracle: Oracle) -> None:
    rng = random.Random(SEED + 2)
    regions = _regions(oracle)
    positions = [rng.randrange(*rng.choice(regions)) for _ in range(140)]  # inside a tensor's region
    positions += [rng.randrange(BLOB_ALIGN, len(oracle.data)) for _ in range(40)]  # mostly alignment padding
    for position in positions:
        outcome = oracle.judge(_flip(oracle.data, position, rng), f"blob flip at {position}")
        inside = any(start <= position < end for start, end in regions)
        assert outcome == ("rejected" if inside else "equal"), position


def test_truncation_at_every_boundary_and_at_random(oracle: Oracle) -> None:
    rng = random.Random(SEED + 3)
    cuts = {0, 1, 4, 8, 15, 16, PREAMBLE.size + oracle.header_len, BLOB_ALIGN}
    for t in oracle.header["tensors"]:
        for key in ("offset", "scale_offset", "bias_offset"):
            if key in t:
                cuts.add(BLOB_ALIGN + t[key])
        cuts.add(BLOB_ALIGN + t["offset"] + t["length"])
    cuts |= {c + d for c in list(cuts) for d in (-1, 1)}
    cuts |= {rng.randrange(len(oracle.data)) for _ in range(60)}
    for cut in sorted(c for c in cuts if 0 <= c < len(oracle.data)):
        assert oracle.judge(oracle.data[:cut], f"truncated at {cut}") == "rejected", cut


def test_wrong_header_lengths(oracle: Oracle) -> None:
    rng = random.Random(SEED + 4)
    size = len(oracle.data)
    lengths = [0, 1, oracle.header_len - 1, oracle.header_len + 1, size - 16, size - 15, size, 2**32, 2**63, 2**64 - 1]
    lengths += [rng.randrange(2**64) for _ in range(20)] + [rng.randrange(size) for _ in range(20)]
    for header_len in lengths:
        damaged = oracle.data[:8] + struct.pack("<Q", header_len) + oracle.data[16:]
        assert oracle.judge(damaged, f"header_len {header_len}") == "rejected", header_len


def test_broken_json_text(oracle: Oracle) -> None:
    rng = random.Random(SEED + 5)
    _, blob = split_file(oracle.path)
    text = oracle.data[PREAMBLE.size : PREAMBLE.size + oracle.header_len]
    for _ in range(80):
        start = rng.randrange(len(text))
        kind = rng.randrange(3)
        if kind == 0:  # replace a character with JSON punctuation or a digit
            broken = text[:start] + bytes([rng.choice(b'{}[]",:0123456789-e. ')]) + text[start + 1 :]
        elif kind == 1:  # delete a span
            broken = text[:start] + text[start + rng.randrange(1, 40) :]
        else:  # cut the JSON short, with the header length telling the truth
            broken = text[:start]
        oracle.judge(
            assemble(oracle.path.with_name("x.base"), broken, blob).read_bytes(), f"json edit {kind} at {start}"
        )


def _mutate_entry(header: dict[str, Any], rng: random.Random, blob_len: int) -> str:
    tensors = header["tensors"]
    t = rng.choice(tensors)
    other = rng.choice(tensors)
    choice = rng.randrange(10)
    if choice == 0:
        t["offset"] = blob_len + rng.choice([0, 64, 16384])  # past the end
    elif choice == 1:
        t["offset"] = other["offset"] + rng.choice([0, 64])  # onto another region
    elif choice == 2:
        t["length"] += rng.choice([-64, -1, 1, 64, 2**40])
    elif choice == 3:
        t["shape"] = [d * 2 for d in t["shape"]] if rng.random() < 0.5 else t["shape"][::-1]
    elif choice == 4:
        t["dtype"] = rng.choice(DTYPES)
    elif choice == 5:
        t["name"] = other["name"]
    elif choice == 6:
        t.pop(rng.choice(sorted(t)))
    elif choice == 7:
        t[rng.choice(["group_size", "scale_offset", "bias_offset", "offset"])] = rng.choice(
            [-1, 0, 16, 2**62, "1", None, 1.5]
        )
    elif choice == 8:
        t["offset"] = rng.randrange(blob_len)
    else:
        header["tensors"] = tensors[::-1] if rng.random() < 0.5 else tensors[:-1]
    return f"entry mutation {choice} on {t.get('name')}"


def test_inconsistent_tensor_entries(oracle: Oracle) -> None:
    rng = random.Random(SEED + 6)
    _, blob = split_file(oracle.path)
    for _ in range(120):
        header = copy.deepcopy(oracle.header)
        label = _mutate_entry(header, rng, len(blob))
        damaged = assemble(oracle.path.with_name("x.base"), canonical_json(header), blob).read_bytes()
        outcome = oracle.judge(damaged, label)
        if header["tensors"] != oracle.header["tensors"]:
            assert outcome == "rejected", label


def test_trailing_slots_are_ignored(oracle: Oracle) -> None:
    assert oracle.judge(oracle.data + b"\x01" * 100, "trailing bytes") == "equal"
