"""The CPU dense-attention kernel (a vision tower's: no cache, every row of a segment over every row
of it) against the pure-MLX reference, on every instruction set; and which path serves a call.

Cases cover head_dim on and off the 16-float vector width (SigLIP's 72, Qwen2.5-VL's 80), a
sequence that ends inside a 64-key block and inside a 16-key panel, segments of unequal length
with an empty one (Qwen2.5-VL's windows), strided inputs (views of one fused projection), and one
row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu, dense_attention
from baselm.dense_attention import dense_attention_reference
from tests.cpu.conftest import off_the_main_thread, requires_kernels

CASES = {
    "siglip_d72": (300, 4, 72, None),
    "d80_windows": (200, 3, 80, (0, 64, 64, 128, 137, 200)),
    "d64_one_block": (64, 2, 64, None),
    "d16_panel_tail": (83, 2, 16, (0, 5, 83)),
    "d8_tiny_heads": (40, 5, 8, (0, 1, 40)),
    "one_row": (1, 2, 32, None),
}
TOLERANCE = 2e-5  # outputs of magnitude ~2, keys summed in another order than MLX's


def qkv(seq: int, heads: int, head_dim: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array((2 * rng.standard_normal((seq, heads, head_dim))).astype(np.float32)) for _ in range(3))


def max_error(seq: int, heads: int, head_dim: int, segments) -> float:
    q, k, v = qkv(seq, heads, head_dim)
    expected = dense_attention_reference(q, k, v, head_dim**-0.5, segments)
    got = dense_attention.dense_attention(q, k, v, head_dim**-0.5, segments)
    assert got.shape == (seq, heads, head_dim) and got.dtype == mx.float32
    return float(mx.abs(got - expected).max())


@pytest.mark.parametrize("name", CASES)
def test_every_instruction_set_matches_the_reference(kernels, name):
    assert max_error(*CASES[name]) < TOLERANCE


@requires_kernels
def test_a_whole_image_split_over_threads_matches_the_reference():
    # 1,024 patches of 12 heads (SigLIP at 512/16): large enough for the thread pool
    q, k, v = qkv(1024, 12, 64, seed=3)
    assert dense_attention.kernel_applies(q)
    got, expected = dense_attention.dense_attention(q, k, v, 0.125), dense_attention_reference(q, k, v, 0.125)
    assert float(mx.abs(got - expected).max()) < 5e-5  # 1,024 keys a row: more rounding than the short cases


@requires_kernels
def test_views_of_a_fused_projection_are_read_in_place():
    q, k, v = qkv(50, 3, 24, seed=1)
    fused = mx.stack([q, k, v], axis=1)  # (seq, 3, heads, head_dim), as a qkv projection reshaped
    views = fused[:, 0], fused[:, 1], fused[:, 2]
    got = cpu.kernels.dense_attention(*views, 0.2, mx.array([0, 20, 50], dtype=mx.int32))
    assert float(mx.abs(got - dense_attention_reference(q, k, v, 0.2, (0, 20, 50))).max()) < TOLERANCE


def test_without_the_module_the_reference_runs(monkeypatch):
    monkeypatch.setattr(cpu, "kernels", None)
    q, k, v = qkv(30, 2, 16)
    assert not dense_attention.kernel_applies(q)
    assert mx.array_equal(dense_attention.dense_attention(q, k, v, 0.25), dense_attention_reference(q, k, v, 0.25))


def test_other_dtypes_take_the_reference():
    q, k, v = (t.astype(mx.float16) for t in qkv(30, 2, 16))
    assert not dense_attention.kernel_applies(q)
    assert dense_attention.dense_attention(q, k, v, 0.25).dtype == mx.float16


def test_segments_must_cover_the_sequence():
    q, k, v = qkv(10, 1, 16)
    with pytest.raises(ValueError, match="segments must ascend from 0 to the sequence length 10"):
        dense_attention.dense_attention(q, k, v, 0.25, (0, 6, 4, 10))
    with pytest.raises(ValueError, match="segments must ascend"):
        dense_attention.dense_attention(q, k, v, 0.25, (0, 9))


@requires_kernels
def test_bad_inputs_are_refused_with_a_reason():
    q, k, v = qkv(10, 2, 16)
    bounds = mx.array([0, 10], dtype=mx.int32)
    with pytest.raises(ValueError, match="float32"):
        cpu.kernels.dense_attention(q.astype(mx.float16), k, v, 0.1, bounds)
    with pytest.raises(ValueError, match="one shape"):
        cpu.kernels.dense_attention(q, k[:5], v, 0.1, bounds)
    with pytest.raises(ValueError, match="int32"):
        cpu.kernels.dense_attention(q, k, v, 0.1, bounds.astype(mx.int64))
    with pytest.raises(RuntimeError, match="end at the sequence length 10"):
        bad = mx.array([0, 9], dtype=mx.int32)
        mx.eval(q, k, v, bad)  # made here; another thread's evaluation cannot run this thread's stream
        off_the_main_thread(lambda: mx.eval(cpu.kernels.dense_attention(q, k, v, 0.1, bad)))
