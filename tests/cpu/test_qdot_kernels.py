"""The integer-activation kernels (csrc/qdot_impl.h) against a reference that quantizes the
activations the same way: blocks of 32 values, d = max|x| / 127 (8-bit codes) or / 32767
(16-bit), codes round(x / d) ties to even. The integer dot of each block is then exact, so the
kernel and the reference differ only in float32 rounding of the per-block products and their sum."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu

BLOCK = 32
RTOL = 1e-5  # of the sum of |terms|: float32 rounding of a few hundred block products


@pytest.fixture(params=[16, 8])
def fast(kernels, request: pytest.FixtureRequest) -> Iterator[object]:
    """The kernels on the integer path with 16- or 8-bit activation codes (whatever
    BASE_CPU_EXACT said), restored afterwards."""
    before = kernels.exact_setting(), kernels.activation_bits()
    kernels.set_exact(False)
    kernels.set_activation_bits(request.param)
    yield kernels
    kernels.set_exact(before[0])
    kernels.set_activation_bits(before[1])


def reference(
    x: np.ndarray, codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, width: int
):
    """(y, bound): the product with `width`-bit activations in float64, and its rounding bound."""
    top = np.float32(127 if width == 8 else 32767)
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    d = np.abs(blocks).max(-1) / top
    inverse = np.where(d != 0, np.float32(1) / np.where(d == 0, np.float32(1), d), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[..., None]), -top, top).astype(np.int64)
    s = np.array(scales.astype(mx.float32), dtype=np.float64)
    c = np.array(biases.astype(mx.float32), dtype=np.float64)
    w = np.array(mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits))
    n = w.shape[0]
    grouped = w.astype(np.float64).reshape(n, k // group_size, group_size)
    ints = np.rint((grouped - c[..., None]) / np.where(s == 0, 1, s)[..., None]).astype(np.int64)
    ints = ints.reshape(n, k // BLOCK, BLOCK)
    per = group_size // BLOCK
    s_block, c_block = np.repeat(s, per, axis=1), np.repeat(c, per, axis=1)
    dots = np.einsum("mbi,nbi->mnb", q, ints).astype(np.float64)
    sums = blocks.astype(np.float64).sum(-1)
    terms = dots * s_block[None] * d.astype(np.float64)[:, None, :]
    y = terms.sum(-1) + np.einsum("nb,mb->mn", c_block, sums)
    bound = RTOL * (np.abs(terms).sum(-1) + np.abs(blocks).sum(-1) @ np.abs(c_block).T) + 1e-6
    return y, bound


def _check(actual: mx.array, x, codes, scales, biases, group_size: int, bits: int, bias=None) -> None:
    from baselm import cpu

    width = cpu.kernels.activation_bits()
    expected, bound = reference(np.array(x), codes, scales, biases, group_size, bits, width)
    if bias is not None:
        expected = expected + np.array(bias, dtype=np.float64)
    worst = (np.abs(np.array(actual, dtype=np.float64) - expected) / bound).max()
    assert worst <= 1.0, f"error {worst:.2f} times the rounding bound"


def _quantized(n: int, k: int, group_size: int, bits: int, scale_dtype=mx.float16, seed: int = 0):
    mx.random.seed(seed)
    codes, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size, bits)
    return codes, scales.astype(scale_dtype), biases.astype(scale_dtype)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_every_width_group_and_scale_type(fast, bits: int, group_size: int, scale_dtype: mx.Dtype) -> None:
    k = group_size * 3  # 3 groups of 1, 2 or 4 blocks: runs of 8 blocks and tails
    codes, scales, biases = _quantized(37, k, group_size, bits, scale_dtype, seed=bits * 13 + group_size)
    for rows in (1, 2, 3, 4, 5, 9):
        x = mx.random.normal((rows, k))
        _check(
            fast.affine_linear(x, codes, scales, biases, group_size, bits), x, codes, scales, biases, group_size, bits
        )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_every_number_of_rows_up_to_32_then_float_activations(fast, bits: int) -> None:
    """Register tiles of 1-4 activation rows and 1, 2 or 4 weight rows, and their remainders, up
    to qdot_max_rows; past it (prefill) the float32 path, equal to the dequantized matmul."""
    assert fast.qdot_max_rows() == 32
    codes, scales, biases = _quantized(23, 160, 32, bits, seed=bits)
    for rows in range(1, 33):
        x = mx.random.normal((rows, 160)) * 3.0
        _check(fast.affine_linear(x, codes, scales, biases, 32, bits), x, codes, scales, biases, 32, bits)
    dense = mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits)
    for rows in (33, 64):
        x = mx.random.normal((rows, 160))
        expected = np.array(x @ dense.T)
        actual = np.array(fast.affine_linear(x, codes, scales, biases, 32, bits))
        assert np.abs(actual - expected).max() < 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_a_row_is_the_same_in_any_batch(fast, bits: int, group_size: int) -> None:
    """Up to qdot_max_rows rows, a row's result does not depend on its neighbours: bit for bit in
    any batch of 2 or more rows (every tile sums a row's blocks in one order, whatever the size
    of its chunk), and alone (one row sums its blocks on four accumulators, for speed) equal up
    to float32 rounding. 70 weight rows: runs of 8 and a remainder; 384 columns: 12 blocks."""
    codes, scales, biases = _quantized(70, 384, group_size, bits, seed=5)
    x = mx.random.normal((32, 384))
    together = np.array(fast.affine_linear(x, codes, scales, biases, group_size, bits))
    for i, rows in ((0, 2), (4, 3), (17, 5), (30, 2), (8, 9)):
        batch = np.array(fast.affine_linear(x[i : i + rows], codes, scales, biases, group_size, bits))
        assert np.array_equal(batch, together[i : i + rows])
    for i in (0, 4, 17, 30):
        alone = np.array(fast.affine_linear(x[i : i + 1], codes, scales, biases, group_size, bits))
        np.testing.assert_allclose(alone[0], together[i], rtol=1e-5, atol=1e-6 * np.abs(together[i]).max())


def test_bias_leading_axes_and_non_contiguous_activations(fast) -> None:
    codes, scales, biases = _quantized(50, 192, 64, 5, seed=3)
    bias = mx.random.normal((50,))
    x = mx.random.normal((2, 3, 192))
    out = fast.affine_linear(x, codes, scales, biases, 64, 5, bias)
    assert out.shape == (2, 3, 50)
    _check(out.reshape(6, 50), x.reshape(6, 192), codes, scales, biases, 64, 5, bias)
    strided = mx.random.normal((192, 8))[:, ::2].T  # (4, 192) with column strides
    _check(fast.affine_linear(strided, codes, scales, biases, 64, 5), strided, codes, scales, biases, 64, 5)


def test_outliers_zero_blocks_and_extreme_codes(fast) -> None:
    """A block of zeros (d = 0), a block with one huge value, and codes at 0 and 2^bits - 1."""
    k = 128
    x = np.array(mx.random.normal((3, k)))
    x[0, :32] = 0.0
    x[1, 40] = 1e4
    x[2, 64:96] = -7.5
    x = mx.array(x)
    for bits in (3, 8):
        top = (1 << bits) - 1
        w = np.where(np.arange(k)[None, :] % 2 == 0, 0.0, float(top))
        w = mx.array(np.repeat(w, 9, axis=0).astype(np.float32))
        codes, scales, biases = mx.quantize(w + mx.random.normal((9, k)) * 0.01, 32, bits)
        _check(fast.affine_linear(x, codes, scales, biases, 32, bits), x, codes, scales, biases, 32, bits)


def test_large_weights_split_across_threads(fast) -> None:
    """Weights past the thread pool's size rule: rows claimed in chunks by every thread."""
    codes, scales, biases = _quantized(3000, 512, 32, 5, seed=9)
    x = mx.random.normal((3, 512))
    _check(fast.affine_linear(x, codes, scales, biases, 32, 5), x, codes, scales, biases, 32, 5)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_rows_longer_than_a_run_of_unpacked_blocks(fast, bits: int) -> None:
    """K of 35 blocks: `generic` unpacks a weight row 32 blocks at a time, so its rows end in a
    short run; 1, 3 and 32 activation rows (the most the integer path takes)."""
    codes, scales, biases = _quantized(21, 35 * BLOCK, 32, bits, seed=13)
    for rows in (1, 3, 32):
        x = mx.random.normal((rows, 35 * BLOCK))
        _check(fast.affine_linear(x, codes, scales, biases, 32, bits), x, codes, scales, biases, 32, bits)


def test_the_exact_path_keeps_float_activations(kernels) -> None:
    """set_exact(True) (BASE_CPU_EXACT=1) multiplies float32 activations: the dequantized
    matmul up to float rounding, which 8-bit activations do not reach."""
    before = kernels.exact_setting(), kernels.activation_bits()
    codes, scales, biases = _quantized(16, 256, 32, 4, seed=11)
    x = mx.random.normal((2, 256))
    dense = mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), 32, 4)
    expected = np.array(x @ dense.T)
    try:
        kernels.set_exact(True)
        exact = np.array(kernels.affine_linear(x, codes, scales, biases, 32, 4))
        kernels.set_exact(False)
        kernels.set_activation_bits(8)
        fast8 = np.array(kernels.affine_linear(x, codes, scales, biases, 32, 4))
        kernels.set_activation_bits(16)
        fast16 = np.array(kernels.affine_linear(x, codes, scales, biases, 32, 4))
    finally:
        kernels.set_exact(before[0])
        kernels.set_activation_bits(before[1])
    scale = np.abs(expected).max()
    assert np.abs(exact - expected).max() < 1e-4
    assert 1e-3 * scale < np.abs(fast8 - expected).max() < 0.05 * scale  # 8-bit codes: visible, bounded
    error8, error16 = np.abs(fast8 - expected).max(), np.abs(fast16 - expected).max()
    assert error16 < 2e-4 * scale and error16 < error8 / 50  # 16-bit codes: a 256 times finer step


@pytest.mark.skipif(not cpu.available(), reason="CPU kernels not loaded")
def test_the_int8_kernels_named_for_each_instruction_set() -> None:
    before = cpu.kernels.isa()
    try:
        names = {}
        for isa in cpu.kernels.supported_isas():
            cpu.kernels.set_isa(isa)
            names[isa] = cpu.kernels.qdot_isa()
    finally:
        cpu.kernels.set_isa(before)
    assert names["generic"] == "generic"
    assert names.get("avx2", "avx2") == "avx2"
    assert names.get("avx512", "avx512-vnni") in ("avx512-vnni", "avx2")


def test_activation_bits_are_8_or_16(kernels) -> None:
    with pytest.raises(ValueError, match="8 or 16"):
        kernels.set_activation_bits(4)


@pytest.mark.skipif(not cpu.available(), reason="CPU kernels not loaded")
def test_the_bandwidth_probe_reads_every_word() -> None:
    words = np.random.default_rng(3).integers(0, 2**63, size=3 * (1 << 17) + 5, dtype=np.uint64)
    expected = int(np.bitwise_xor.reduce(words))
    assert cpu.kernels.read_xor(mx.array(words.view(np.uint32))) == expected


def test_by_default_every_instruction_set_takes_integer_activations(kernels) -> None:
    """Left to itself (BASE_CPU_EXACT unset) every build, `generic` included (its plain loops
    vectorized by the compiler), takes integer activations; set_exact(True) takes float32 ones."""
    before = kernels.exact_setting()
    try:
        kernels.set_exact(None)
        assert kernels.exact_setting() is None
        assert kernels.exact() is False
        kernels.set_exact(True)
        assert kernels.exact() is True and kernels.exact_setting() is True
    finally:
        kernels.set_exact(before)
