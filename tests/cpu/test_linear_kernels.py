"""The few-row linear kernels against MLX's own ops: float32 `x @ w.T (+ b)` and the affine
quantized form against `mx.dequantize` + float32 matmul, over odd shapes and every layout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

# Sums of up to K float32 products in another order: relative to the sum of |products|.
RTOL = 2e-6


def _close(actual: mx.array, expected: mx.array, x: mx.array, w: mx.array) -> None:
    """Equal up to float32 rounding of a K-term dot product."""
    bound = (mx.abs(x) @ mx.abs(w).T) * RTOL * 8 + 1e-6
    diff = mx.abs(actual - expected)
    worst = mx.max(diff / bound).item()
    assert actual.shape == expected.shape
    assert worst <= 1.0, f"max error {mx.max(diff).item()} exceeds the rounding bound"


def _reference_weight(codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The float32 weight mx.dequantize gives with float32 scales (f16/bf16 widen exactly)."""
    return mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32, 33])
@pytest.mark.parametrize("k", [1, 7, 16, 33, 100, 576])
def test_dense_matches_matmul(kernels, rows: int, k: int) -> None:
    mx.random.seed(rows * 1000 + k)
    x = mx.random.normal((rows, k))
    w = mx.random.normal((37, k))  # 37 rows: full tiles, a partial tile and a partial chunk
    _close(kernels.dense_linear(x, w), x @ w.T, x, w)


def test_dense_bias_and_leading_axes(kernels) -> None:
    mx.random.seed(1)
    x = mx.random.normal((2, 3, 45))
    w = mx.random.normal((70, 45))
    b = mx.random.normal((70,))
    out = kernels.dense_linear(x, w, b)
    assert out.shape == (2, 3, 70)
    _close(out.reshape(6, 70), (x.reshape(6, 45) @ w.T + b), x.reshape(6, 45), w)


def test_dense_takes_transposed_and_sliced_inputs(kernels) -> None:
    mx.random.seed(2)
    wt = mx.random.normal((40, 90))  # used transposed: (90, 40) with column strides
    x = mx.random.normal((40, 6))[:, ::2].T  # (3, 40), non-contiguous
    w = wt.T
    _close(kernels.dense_linear(x, w), x @ w.T, x, w)
    big = mx.random.normal((100, 40))
    part = big[10:50]  # a row slice: contiguous rows at an offset
    _close(kernels.dense_linear(x, part), x @ part.T, x, part)


@pytest.mark.parametrize("k", [513, 1537, 2048])
def test_dense_rows_longer_than_the_prefetch_distance(kernels, k: int) -> None:
    """Rows read ahead of the loads: odd tails, and weights ending where their buffer ends."""
    mx.random.seed(k)
    w = mx.random.normal((23, k))
    for rows in (1, 2, 5):
        x = mx.random.normal((rows, k))
        _close(kernels.dense_linear(x, w), x @ w.T, x, w)
        last = w[-6:]  # the buffer's final rows: the read-ahead runs past its end
        _close(kernels.dense_linear(x, last), x @ last.T, x, last)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_affine_matches_dequantized_matmul(kernels, bits: int, group_size: int, scale_dtype: mx.Dtype) -> None:
    mx.random.seed(bits * 7 + group_size)
    k = group_size * 3
    w = mx.random.normal((21, k))
    codes, scales, biases = mx.quantize(w, group_size, bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    dense = _reference_weight(codes, scales, biases, group_size, bits)
    for rows in (1, 2, 3, 4, 5, 9):  # up to 4 rows decode in registers (4- and 8-bit), more through a buffer
        x = mx.random.normal((rows, k))
        _close(kernels.affine_linear(x, codes, scales, biases, group_size, bits), x @ dense.T, x, dense)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
def test_affine_q4_rows_and_bias(kernels, rows: int) -> None:
    mx.random.seed(rows)
    w = mx.random.normal((75, 576))
    codes, scales, biases = mx.quantize(w, 32, 4)
    bias = mx.random.normal((75,))
    dense = _reference_weight(codes, scales, biases, 32, 4)
    x = mx.random.normal((rows, 576))
    _close(kernels.affine_linear(x, codes, scales, biases, 32, 4, bias), x @ dense.T + bias, x, dense)


@pytest.mark.parametrize("rows", [*range(33, 46), 100])
@pytest.mark.parametrize("k", [7, 300, 608, 2080])
def test_many_rows_run_as_a_gemm_over_panels(kernels, rows: int, k: int) -> None:
    """From 33 activation rows the float32 product runs over panels of 16 decoded weight rows, K in
    slices of 1,024: tiles of activation rows (3 generic, 6 on AVX2, 12 on AVX-512) and every remainder
    of them (33 ... 45), weight rows moved in by eights and
    a short last panel (43 = 16 + 16 + 8 + 3 rows), K tails of the 8x8 transposes, with a bias."""
    mx.random.seed(rows * 7 + k)
    x, w, b = mx.random.normal((rows, k)), mx.random.normal((43, k)), mx.random.normal((43,))
    _close(kernels.dense_linear(x, w, b), x @ w.T + b, x, w)
    if k % 32 == 0:
        codes, scales, biases = mx.quantize(w, 32, 4)
        dense = _reference_weight(codes, scales, biases, 32, 4)
        _close(kernels.affine_linear(x, codes, scales, biases, 32, 4, b), x @ dense.T + b, x, dense)


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_many_rows_of_every_width(kernels, bits: int) -> None:
    mx.random.seed(bits)
    x, w = mx.random.normal((41, 640)), mx.random.normal((50, 640))
    codes, scales, biases = mx.quantize(w, 64, bits)
    dense = _reference_weight(codes, scales, biases, 64, bits)
    _close(kernels.affine_linear(x, codes, scales, biases, 64, bits), x @ dense.T, x, dense)


def test_affine_takes_non_contiguous_activations(kernels) -> None:
    mx.random.seed(4)
    w = mx.random.normal((20, 64))
    codes, scales, biases = mx.quantize(w, 32, 8)
    dense = _reference_weight(codes, scales, biases, 32, 8)
    for rows in (2, 6):
        x = mx.random.normal((64, rows * 2))[:, ::2].T  # (rows, 64), strided
        _close(kernels.affine_linear(x, codes, scales, biases, 32, 8), x @ dense.T, x, dense)


def test_affine_codes_from_a_gguf_block_layout(kernels) -> None:
    """Q4_1 blocks as the GGUF import stores them (f16 scale d, f16 bias m, nibbles packed by
    `pack_codes`) decode to d * q + m."""
    from baselm.store.quantize import pack_codes

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=(9, 64), dtype=np.uint8)
    d = rng.normal(size=(9, 2)).astype(np.float16)
    m = rng.normal(size=(9, 2)).astype(np.float16)
    codes = mx.array(pack_codes(q, 4))
    expected_w = d.astype(np.float32).repeat(32, axis=1) * q + m.astype(np.float32).repeat(32, axis=1)
    x = mx.array(rng.normal(size=(2, 64)).astype(np.float32))
    out = kernels.affine_linear(x, codes, mx.array(d), mx.array(m), 32, 4)
    _close(out, x @ mx.array(expected_w).T, x, mx.array(expected_w))


def test_bad_shapes_are_clear_errors(kernels) -> None:
    x = mx.ones((1, 64))
    with pytest.raises(ValueError, match="w must be float32 of shape"):
        kernels.dense_linear(x, mx.ones((3, 63)))
    codes, scales, biases = mx.quantize(mx.ones((4, 64)), 32, 4)
    with pytest.raises(ValueError, match="codes must be uint32"):
        kernels.affine_linear(x, codes, scales, biases, 32, 8)
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.dense_linear(x.astype(mx.float16), mx.ones((3, 64)))


def test_weights_large_enough_to_split_across_threads(kernels) -> None:
    """Above 512 KiB of weights a call is shared out among the pool's threads."""
    mx.random.seed(5)
    w = mx.random.normal((1100, 130))  # 572 KB of float32
    x = mx.random.normal((3, 130))
    _close(kernels.dense_linear(x, w), x @ w.T, x, w)
    tall = mx.random.normal((5003, 40))  # 800 KB: rows go out in runs of many rows, the last one short
    for rows in (1, 3):
        xt = mx.random.normal((rows, 40))
        _close(kernels.dense_linear(xt, tall), xt @ tall.T, xt, tall)
    wq = mx.random.normal((4200, 128))
    codes, scales, biases = mx.quantize(wq, 32, 8)  # 538 KB of codes
    dense = _reference_weight(codes, scales, biases, 32, 8)
    for rows in (1, 7):
        xq = mx.random.normal((rows, 128))
        _close(kernels.affine_linear(xq, codes, scales, biases, 32, 8), xq @ dense.T, xq, dense)


def test_callers_on_several_threads_at_once_each_get_their_own_answer(kernels) -> None:
    """Each thread evaluates on its own MLX stream (one engine a thread, as a server of several
    models runs them): calls at once must not share a scratch buffer."""
    import threading

    mx.random.seed(11)
    k = 256
    codes, scales, biases = mx.quantize(mx.random.normal((96, k)), 32, 4)  # small: each call runs on its caller
    inputs = [mx.random.normal((9, k)) for _ in range(2)]  # 9 rows: decoded through the scratch buffer
    expected = [np.array(kernels.affine_linear(x, codes, scales, biases, 32, 4)) for x in inputs]
    start = threading.Barrier(2)
    mismatches = [0, 0]

    def call(index: int) -> None:
        start.wait()
        for _ in range(1000):
            got = np.array(kernels.affine_linear(inputs[index], codes, scales, biases, 32, 4))
            mismatches[index] += not np.array_equal(got, expected[index])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert mismatches == [0, 0]
