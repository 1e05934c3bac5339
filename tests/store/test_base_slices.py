"""Reading ranges of a `.base` tensor's rows or columns: the same values as reading it whole and
slicing, and only the ranges' bytes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.store.base_reader import BaseFile, QuantizedArray
from baselm.store.base_slices import Cut
from tests.store.base_helpers import write_small

Q4 = "model.layers.0.self_attn.q_proj.weight"  # q4, (8, 128), groups of 64
Q3 = "model.layers.0.mlp.down_proj.weight"  # q3, (4, 64), groups of 32
F16 = "model.extra.weight"  # f16, (3, 5)


def _whole_then_sliced(value, axis: int, ranges: list[tuple[int, int]]):
    """What the ranges take of a tensor read whole: slices joined along `axis`."""
    if not isinstance(value, QuantizedArray):
        return np.concatenate(
            [np.array(value)[..., a:b, :] if axis == -2 else np.array(value)[..., a:b] for a, b in ranges], axis
        )
    units = {"codes": value.bits / 32, "scales": 1 / value.group_size, "biases": 1 / value.group_size}
    parts = {}
    for field, unit in units.items():
        array = np.array(getattr(value, field))
        if axis == -2:
            parts[field] = np.concatenate([array[a:b] for a, b in ranges])
        else:
            parts[field] = np.concatenate([array[:, int(a * unit) : int(b * unit)] for a, b in ranges], axis=1)
    return parts


@pytest.mark.parametrize(
    ("name", "axis", "ranges"),
    [
        (Q4, -2, [(0, 2), (5, 8)]),  # a fused tensor's row ranges (phi3's q and v rows of qkv_proj)
        (Q4, -1, [(64, 128), (0, 64)]),  # columns on groups, in the order asked
        (Q3, -1, [(32, 64)]),  # 3-bit codes: a group of 32 is 3 whole words
        (F16, -2, [(0, 1), (2, 3)]),
        (F16, -1, [(0, 1), (3, 5)]),
    ],
)
def test_ranges_read_alone_are_the_slices_of_the_tensor_read_whole(tmp_path, name, axis, ranges):
    path = write_small(tmp_path / "small.base")
    whole = BaseFile.open(path).read(name)
    base = BaseFile.open(path)
    got = base.load(cuts={name: [Cut(axis, a, b) for a, b in ranges]})[name]
    want = _whole_then_sliced(whole, axis, ranges)
    entry = base.tensors[name]
    taken = sum(b - a for a, b in ranges)
    if isinstance(got, QuantizedArray):
        for field, array in want.items():
            assert np.array_equal(np.array(getattr(got, field)), array), field
        assert got.shape[axis] == taken
    else:
        assert got.dtype == mx.float16
        assert np.array_equal(np.array(got), want)
    others = sum(e.length for n, e in base.tensors.items() if n != name)
    assert base.bytes_read - others == entry.length * taken // entry.shape[axis]  # the ranges' bytes alone


@pytest.mark.parametrize(
    "cuts",
    [
        [Cut(-2, 0, 2), Cut(-1, 0, 64)],  # two axes at once
        [Cut(-1, 0, 32)],  # half a group of 64
        [Cut(-2, 6, 9)],  # past the last row
        [],
    ],
)
def test_ranges_that_cannot_be_read_as_stored_are_refused(tmp_path, cuts):
    base = BaseFile.open(write_small(tmp_path / "small.base"))
    with pytest.raises(ValueError, match="do not fit"):
        base.load(cuts={Q4: cuts})
