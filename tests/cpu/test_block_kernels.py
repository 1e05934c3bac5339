"""The block kernels (csrc/legacy_blocks_impl.h, kquants_impl.h, blocks_impl.h, qdot_blocks_impl.h):
matmuls straight on GGUF blocks, the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the super-blocks
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, on every instruction set this CPU runs.

What is checked against what:
- `block_dequantize` against the gguf package's decoder (the reference llama.cpp's Python ships),
  bit for bit.
- The integer path (up to qdot_max_rows activation rows, the default) against `reference`, which
  parses the blocks in numpy from ggml's layouts (block_layouts.py, not through the kernels or gguf)
  and quantizes the activations as the kernels do: blocks of 32 values, d = max|x| / 32767, codes
  rint(x * (1 / d)) ties to even. Every block's integer dot is then exact, so kernel and reference differ only in
  float32 rounding of the per-block products and their sum: at most RTOL of the sum of |terms|.
  The offsets meet the float sums of their 32 activations, Q2_K's minimums those of their 16.
- The float path (set_exact(True), or more than qdot_max_rows rows) against the float64 product of
  the gguf-decoded weights, within float32 rounding: FLOAT_RTOL of the sum of |x| * |w|.
Legacy rows are taken in runs of 8 blocks, so their widths here end in a run of 1 to 7 (WIDTHS).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache

import mlx.core as mx
import numpy as np
import pytest

from baselm import gguf_blocks
from tests.cpu.block_layouts import BLOCK, CODE_FIELDS, FIELDS, KINDS, is_kquant, parse
from tests.forward import exact_path
from tests.tiny_gguf import random_blocks, same_bits

RTOL = 1e-5  # of the sum of |terms|: float32 rounding of a few hundred block products
FLOAT_RTOL = 1e-5  # of the sum of |x * w|: float32 sums of up to 2848 products


# Row widths: K-quants 1, 3 and 11 super-blocks; legacy 1, 7, 25 and 89 blocks (runs of 8 and a rest).
WIDTHS = {kind: (256, 768, 2816) if is_kquant(kind) else (32, 224, 800, 2848) for kind in KINDS}
# A width of several runs, the legacy one with a last run of 1 block.
ODD = {kind: 768 if is_kquant(kind) else 800 for kind in KINDS}
KIND_WIDTHS = [(kind, cols) for kind in KINDS for cols in WIDTHS[kind]]


@pytest.fixture
def integer(kernels) -> Iterator[object]:
    """The kernels on the integer path (whatever BASE_CPU_EXACT said), restored afterwards."""
    with exact_path(kernels, False):
        yield kernels


@pytest.fixture(params=[False, True], ids=["integer", "exact"])
def path(kernels, request: pytest.FixtureRequest) -> Iterator[object]:
    """The kernels on the integer path, then on the exact (float activation) one."""
    with exact_path(kernels, request.param):
        yield kernels


def _num_blocks(kind: str, cols: int) -> int:
    return cols // gguf_blocks.BY_SUFFIX[kind].block_values


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, cols / block values * block bytes) random blocks, d (and a legacy m) of either sign
    (llama.cpp's Q6_K d is negative as often as not; the kernels should not care for any type)."""
    raw = random_blocks(kind.upper(), rows, cols, seed).reshape(rows, _num_blocks(kind, cols), -1)
    rng = np.random.default_rng(seed + 1)
    for name in ("d", "m") if "m" in FIELDS[kind] else ("d",):
        flip = rng.random(raw.shape[:2]) < 0.5
        raw[..., FIELDS[kind][name].start + 1] ^= np.where(flip, 0x80, 0).astype(np.uint8)  # the f16 sign bit
    return raw.reshape(rows, -1)


def _values(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """The float32 values (rows, cols) as the gguf package decodes them."""
    return gguf_blocks.dequantize(gguf_blocks.BY_SUFFIX[kind].dtype, raw, (raw.shape[0], cols))


def _activations(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 3.0


@cache
def _weights(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]:
    """(blocks, parse(blocks), gguf-decoded values), made once for every instruction set's run."""
    raw = _blocks(kind, rows, cols, seed)
    return raw, parse(kind, raw, cols), _values(kind, raw, cols)


# What the 8-bit GEMM adds to a code to make it unsigned (the offset goes into the sub-block's c).
SHIFT = {"q8_0": 128, "iq4_nl": 128, "iq4_xs": 128, "q6_k": 32, "q3_k": 4}


def gemm_codes(kernels, kind: str) -> tuple[int, int]:
    """(top, shift) of the integer GEMM's activation codes and weight codes for `kind` now: 8 bits (VNNI
    only), codes to 127 against codes moved up by SHIFT; 16 bits, codes to 32767 (against Q6_K's, which
    carry their scale, 16383) against signed codes."""
    if kernels.activation_bits() == 8 and kernels.qdot_isa() == "avx512-vnni":  # AVX2's GEMM: 16 bits only
        return 127, SHIFT.get(kind, 0)
    return (16383 if kind == "q6_k" else 32767), 0


def reference(
    x: np.ndarray, fields: tuple[np.ndarray, ...], top: int = 32767, shift: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): x @ W.T with activation codes up to `top` in blocks of 32, in float64, and its
    rounding bound. The few-row integer path (shift None): offsets meet the float sums of their 32
    values, Q2_K's minimums those of their 16. The integer GEMM past qdot_max_rows rows (shift: what it
    adds to the kind's codes, gemm_codes): both meet the sums of the quantized values (d times the
    codes' sum), and the bound counts the codes moved up by `shift`."""
    codes, scales, offsets, minimums = fields
    top = np.float32(top)
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    d = np.abs(blocks).max(-1) / top  # (m, k / 32) float32
    inverse = np.where(d != 0, np.float32(1) / np.where(d == 0, np.float32(1), d), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[..., None]), -top, top).astype(np.float64)
    groups, size = codes.shape[1:]

    def products(a: np.ndarray, c: np.ndarray) -> np.ndarray:  # (groups, m, size) @ (groups, size, n): exact sums
        return np.matmul(a.reshape(m, groups, size).transpose(1, 0, 2), c.transpose(1, 2, 0)).transpose(1, 2, 0)

    dx = np.repeat(d.astype(np.float64), BLOCK // size, axis=1)[:, None, :]
    terms = products(q, codes) * scales[None] * dx  # (m, n, groups)
    sums = blocks.astype(np.float64) if shift is None else q * d.astype(np.float64)[..., None]
    halves = sums.reshape(m, k // 16, 16)
    y = terms.sum(-1) + sums.sum(-1) @ offsets.T + halves.sum(-1) @ minimums.T
    if shift is None:
        magnitude = np.abs(terms).sum(-1)
    else:  # the kernel's integer sums are of the moved codes, and its offsets take the shift back out
        magnitude = (products(np.abs(q), np.abs(codes) + shift) * np.abs(scales[None] * dx)).sum(-1)
        magnitude += shift * np.abs(sums.reshape(m, groups, size).sum(-1)) @ np.abs(scales).T
    bound = RTOL * (
        magnitude
        + np.abs(sums.reshape(m, k // BLOCK, BLOCK)).sum(-1) @ np.abs(offsets).T
        + np.abs(halves).sum(-1) @ np.abs(minimums).T
    )
    return y, bound + 1e-6


def _check(
    kernels, x: np.ndarray, weights: tuple, out: mx.array, bias: np.ndarray | None = None, kind: str = ""
) -> None:
    """out against the path the kernels take for x: the GEMM's reference (from block_gemm_min_rows
    rows, where the ISA has the integer GEMM: gemm_codes), the 16-bit few-row reference (fewer, up to
    qdot_max_rows), or the float product (past them without the GEMM, and the exact path)."""
    _, fields, values = weights
    actual = np.array(out, dtype=np.float64)
    rows = x.shape[0]
    gemm = kernels.integer_gemm() and rows >= kernels.block_gemm_min_rows()
    if kernels.exact() or (rows > kernels.qdot_max_rows() and not gemm):
        x64, w64 = x.astype(np.float64), values.astype(np.float64)
        expected, bound = x64 @ w64.T, FLOAT_RTOL * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    elif gemm:
        assert kind, "the GEMM's reference needs the kind (its codes' shift)"
        expected, bound = reference(x, fields, *gemm_codes(kernels, kind))
    else:
        expected, bound = reference(x, fields)
    if bias is not None:
        expected = expected + bias
    worst = (np.abs(actual - expected) / bound).max()
    assert worst <= 1.0, f"error {worst:.2f} times the rounding bound"


def _linear(kernels, x: np.ndarray, kind: str, raw: np.ndarray, bias: np.ndarray | None = None) -> mx.array:
    return kernels.block_linear(mx.array(x), mx.array(raw), kind, None if bias is None else mx.array(bias))


@pytest.mark.parametrize(("kind", "cols"), KIND_WIDTHS)
def test_blocks_decode_as_the_gguf_package_decodes_them(kernels, kind: str, cols: int) -> None:
    raw, _, values = _weights(kind, 37, cols, seed=cols)
    assert same_bits(np.array(kernels.block_dequantize(mx.array(raw), kind)), values)


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_parses_blocks_as_the_gguf_package_does(kind: str) -> None:
    """The reference's own parse of the bytes gives gguf's values: codes * scales + offsets."""
    cols = ODD[kind]
    raw, (codes, scales, offsets, minimums), values = _weights(kind, 37, cols, seed=cols)
    parsed = (codes * scales[..., None]).reshape(37, cols) + np.repeat(offsets, BLOCK, axis=1)
    parsed += np.repeat(minimums, 16, axis=1)
    assert same_bits(parsed.astype(np.float32), values)


@pytest.mark.parametrize("kind", KINDS)
def test_every_number_of_rows_up_to_32_and_past_it(integer, kind: str) -> None:
    """Register tiles of 1-4 activation rows and their remainders, one row alone, up to qdot_max_rows
    or block_gemm_min_rows; from there the GEMM's tiles (VNNI: 8 rows in pairs of lanes, 16, 32 with
    padding; AVX2: 8 and 16), and 33, the first past qdot_max_rows (float32 activations without the
    integer GEMM)."""
    assert integer.qdot_max_rows() == 32
    assert integer.block_gemm_min_rows() == {"avx512-vnni": 6, "avx2": 16, "generic": 0}[integer.qdot_isa()]
    cols = ODD[kind]
    weights = _weights(kind, 37, cols, seed=1)
    for rows in range(1, 34):
        x = _activations(rows, cols, seed=rows)
        _check(integer, x, weights, _linear(integer, x, kind, weights[0]), kind=kind)


@pytest.mark.parametrize(("kind", "cols"), KIND_WIDTHS)
def test_every_row_width_and_weight_tile_remainder(integer, kind: str, cols: int) -> None:
    """Every width of WIDTHS; weight rows in runs of 8 and 64 and chunks of 16 threads claim, with
    their remainders (1, 5, 37, 70)."""
    for n in (1, 5, 37, 70):
        weights = _weights(kind, n, cols, seed=n)
        for rows in (1, 2, 3, 4, 7, 32):
            x = _activations(rows, cols, seed=100 * n + rows)
            _check(integer, x, weights, _linear(integer, x, kind, weights[0]), kind=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_the_integer_path_follows_16_bit_codes_not_float_activations(integer, kind: str) -> None:
    """16-bit codes are within RTOL of the float product too (Q4_0/Q5_0's offsets -8d and -16d widen
    the bound, so theirs is 0.19 of it); the kernel is much nearer the codes' product, so the
    reference checks the quantization, not only the sum. The few-row loops at 4 rows, and the
    GEMM (its reference) at 8 rows where it takes them."""
    cols = WIDTHS[kind][-1]
    weights = _weights(kind, 70, cols, seed=4)
    gemm = integer.integer_gemm() and integer.block_gemm_min_rows() <= 8
    for rows, codes in ((4, ()), (8, gemm_codes(integer, kind) if gemm else ())):
        x = _activations(rows, cols, seed=4)
        expected, bound = reference(x, weights[1], *codes)
        float_product = x.astype(np.float64) @ weights[2].astype(np.float64).T
        kernel_error = (np.abs(np.array(_linear(integer, x, kind, weights[0]), np.float64) - expected) / bound).max()
        float_error = (np.abs(float_product - expected) / bound).max()
        # (the GEMM's offsets meet the codes' sums, so its bound, and the float product's distance, differ)
        least = 0.03 if codes else 0.1
        assert float_error > least and kernel_error < float_error / 20, (rows, float_error, kernel_error)


@pytest.mark.parametrize("kind", KINDS)
def test_past_32_rows_the_gemm(integer, kind: str) -> None:
    """The integer GEMM's tiles of 48, 32 and 16 rows (VNNI; rows rounded up to 16: 33 -> 48, 100 -> 112
    as 48 + 48 + 16, 130 -> 144 as 3 x 48) or of 16 (AVX2), or the float GEMM of the generic build."""
    cols = ODD[kind]
    weights = _weights(kind, 37, cols, seed=2)
    for rows in (33, 47, 64, 100, 130):
        x = _activations(rows, cols, seed=rows)
        _check(integer, x, weights, _linear(integer, x, kind, weights[0]), kind=kind)


@pytest.mark.parametrize(("kind", "cols"), KIND_WIDTHS)
def test_the_exact_path_is_the_float_matmul(kernels, kind: str, cols: int) -> None:
    """set_exact(True) (BASE_CPU_EXACT=1) multiplies float32 activations by the decoded weights."""
    weights = _weights(kind, 37, cols, seed=3)
    with exact_path(kernels, True):
        for rows in (1, 3, 32, 40):
            x = _activations(rows, cols, seed=rows)
            _check(kernels, x, weights, _linear(kernels, x, kind, weights[0]), kind=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_in_any_batch(integer, kind: str) -> None:
    """On the few-row loops (up to qdot_max_rows rows, or fewer than block_gemm_min_rows where the ISA
    has the integer GEMM), a row's result does not depend on its neighbours: bit for bit in any batch
    of 2 or more rows, and alone (summed on four accumulators) equal up to float32 rounding. 70
    weight rows: runs of 8 and a remainder."""
    cols = ODD[kind]
    raw = _weights(kind, 70, cols, seed=5)[0]
    most = min(32, integer.block_gemm_min_rows() - 1) if integer.integer_gemm() else 32
    x = _activations(most, cols, seed=5)
    together = np.array(_linear(integer, x, kind, raw))
    batches = [(0, 2), (4, 3), (17, 5), (30, 2), (8, 9), (1, 31), (most - 3, 3), (1, most - 1)]
    for i, rows in batches:
        if i + rows <= most:
            assert np.array_equal(np.array(_linear(integer, x[i : i + rows], kind, raw)), together[i : i + rows])
    for i in sorted({0, 4, 17, most - 1} & set(range(most))):
        alone = np.array(_linear(integer, x[i : i + 1], kind, raw))[0]
        np.testing.assert_allclose(alone, together[i], rtol=1e-5, atol=1e-6 * np.abs(together[i]).max())


@pytest.mark.parametrize("kind", KINDS)
def test_activation_bits_do_not_apply_to_blocks(integer, kind: str) -> None:
    """Block codes (Q6_K's times their scale: up to 4096) always meet 16-bit activation codes."""
    cols = ODD[kind]
    raw = _weights(kind, 37, cols, seed=6)[0]
    x = _activations(5, cols, seed=6)
    before = integer.activation_bits()
    try:
        results = []
        for bits in (8, 16):
            integer.set_activation_bits(bits)
            results.append(np.array(_linear(integer, x, kind, raw)))
    finally:
        integer.set_activation_bits(before)
    assert np.array_equal(*results)


@pytest.mark.parametrize("kind", KINDS)
def test_bias_leading_axes_and_non_contiguous_inputs(path, kind: str) -> None:
    weights = _weights(kind, 50, 512, seed=7)
    raw = weights[0]
    bias = np.random.default_rng(7).standard_normal(50, dtype=np.float32)
    x = _activations(6, 512, seed=7)
    out = _linear(path, x.reshape(2, 3, 512), kind, raw, bias)
    assert out.shape == (2, 3, 50)
    _check(path, x, weights, out.reshape(6, 50), bias, kind)
    assert path.block_linear(mx.array(x[0]), mx.array(raw), kind).shape == (50,)
    strided = mx.array(_activations(512, 8, seed=8))[:, ::2].T  # (4, 512) with column strides
    _check(path, np.array(strided), weights, path.block_linear(strided, mx.array(raw), kind), kind=kind)
    every_other = mx.array(raw)[::2]  # (25, bytes): weight rows with a stride
    out = path.block_linear(mx.array(x), every_other, kind)
    _check(path, x, (raw[::2], tuple(f[::2] for f in weights[1]), weights[2][::2]), out, kind=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_large_weights_split_across_threads(integer, kind: str) -> None:
    """4864 x 1536 (Qwen2.5's MLP): weight rows claimed in chunks by every thread of the pool."""
    raw = _blocks(kind, 4864, 1536, seed=9)
    weights = (raw, parse(kind, raw, 1536), _values(kind, raw, 1536))
    for rows in (1, 8):
        x = _activations(rows, 1536, seed=rows)
        _check(integer, x, weights, _linear(integer, x, kind, weights[0]), kind=kind)


def _edge_blocks(kind: str, cols: int) -> np.ndarray:
    """Five weight rows: all bytes zero; d = dmin = 0 (legacy: d = m = 0) under random codes; every
    code and scale at its top (legacy: codes; Q8_0's 127); codes at their bottom with the largest |scale|
    (Q6_K: -32 times -128, the largest |code|, 4096; Q3_K: -4 times -32; IQ4_XS: level -127 times -32;
    Q8_0: -128); scales 0 (legacy: d at float16's largest, 65504)."""
    raw = _blocks(kind, 5, cols, seed=10).reshape(5, _num_blocks(kind, cols), -1)
    f = FIELDS[kind]
    raw[0] = 0
    for name in ("d", "dmin", "m"):
        if name in f:
            raw[1, :, f[name]] = 0
    # Bytes of the top and bottom scale: Q6_K's int8 127, -128; Q3_K's and IQ4_XS's 6-bit 63 and 0 (31, -32).
    top_scale, bottom_scale = {"q6_k": (0x7F, 0x80), "q3_k": (0xFF, 0x00), "iq4_xs": (0xFF, 0x00)}.get(
        kind, (0xFF, 0xFF)
    )
    top_code, bottom_code = (0x7F, 0x80) if kind == "q8_0" else (0xFF, 0x00)  # Q8_0: int8 127, -128
    scale_fields = [name for name in ("scales", "scales_h") if name in f]
    for row, code_byte, scale_byte in ((2, top_code, top_scale), (3, bottom_code, bottom_scale)):
        for name in CODE_FIELDS[kind]:
            raw[row, :, f[name]] = code_byte
        for name in scale_fields:
            raw[row, :, f[name]] = scale_byte
    for name in scale_fields:
        raw[4, :, f[name]] = 0
    if not scale_fields:
        raw[4, :, f["d"]] = np.array([65504.0], np.float16).view(np.uint8)
    return raw.reshape(5, -1)


def edge_case(kind: str, rows: int, seed: int) -> tuple[tuple, np.ndarray]:
    """(weights, x): _edge_blocks' 5 weight rows of 512 values, and `rows` (at least 4) activation rows
    whose first four are a block of zeros (d = 0), one huge value, all ones (every code at its top: the
    largest integer sums), alternating signs (large sums that cancel); the rest random."""
    raw = _edge_blocks(kind, 512)
    x = _activations(rows, 512, seed=seed)
    x[0, :BLOCK] = 0.0
    x[1, 40] = 1e4
    x[2] = 1.0
    x[3] = np.where(np.arange(512) % 2 == 0, 1.0, -1.0)
    return (raw, parse(kind, raw, 512), _values(kind, raw, 512)), x


@pytest.mark.parametrize("kind", KINDS)
def test_zero_blocks_and_extreme_codes(path, kind: str) -> None:
    """edge_case's 4 activation rows against the edge weight blocks."""
    weights, x = edge_case(kind, 4, seed=11)
    _check(path, x, weights, _linear(path, x, kind, weights[0]), kind=kind)


def test_wrong_calls_are_clear_errors(kernels) -> None:
    raw = mx.array(_weights("q4_k", 4, 512, seed=12)[0])
    legacy = mx.array(_weights("q8_0", 4, 512, seed=12)[0])
    x = mx.array(_activations(2, 512, seed=12))
    blocks_shape = "blocks must be uint8 of shape (N, K / 256 * 144)"
    kinds = "q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl (each also as q4_0_runs ...), q2_k, q3_k, q4_k, q5_k, q6_k or iq4_xs"
    cases = [
        (lambda: kernels.block_linear(x.astype(mx.float16), raw, "q4_k"), "block_linear: x must be float32"),
        (lambda: kernels.block_linear(x, raw.astype(mx.int32), "q4_k"), f"block_linear: {blocks_shape}"),
        (lambda: kernels.block_linear(x, raw.reshape(-1), "q4_k"), f"block_linear: {blocks_shape}"),
        (lambda: kernels.block_linear(x, raw[:, :-1], "q4_k"), f"block_linear: {blocks_shape}"),
        (lambda: kernels.block_linear(x[:, :256], raw, "q4_k"), "rows of a different K than x's last axis"),
        (lambda: kernels.block_linear(x, raw, "q5_1"), "rows of a different K than x's last axis"),  # 384 values
        (lambda: kernels.block_linear(x, legacy[:, :-1], "q8_0"), "blocks must be uint8 of shape (N, K / 32 * 34)"),
        (lambda: kernels.block_linear(x, raw, "iq2_xs"), f"unknown block type iq2_xs: {kinds}"),
        (lambda: kernels.block_linear(x, raw, "q4_k", mx.zeros((5,))), "bias must be float32 of shape (N,)"),
        (lambda: kernels.block_linear(x, raw, "q4_k", mx.zeros((4,), mx.float16)), "bias must be float32"),
        (lambda: kernels.block_dequantize(raw.astype(mx.int8), "q4_k"), f"block_dequantize: {blocks_shape}"),
        (lambda: kernels.block_dequantize(raw[:, :100], "q6_k"), "blocks must be uint8 of shape (N, K / 256 * 210)"),
        (lambda: kernels.block_dequantize(raw, "Q4_K"), "unknown block type Q4_K"),
        (lambda: kernels.block_linear(x, raw, "q4_k_runs"), "unknown block type q4_k_runs"),
        (lambda: kernels.block_runs(raw, "q4_k"), "block_runs: q4_k is not a legacy block type"),
        (lambda: kernels.block_runs(raw, "iq4_xs"), "block_runs: iq4_xs is not a legacy block type"),
        (
            lambda: kernels.block_runs(legacy[:, :-1], "q8_0"),
            "block_runs: blocks must be uint8 of shape (N, K / 32 * 34)",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        kernels.block_linear(x, raw, gguf_blocks.BY_SUFFIX["q4_k"].kernel_kind)  # the kind is a name


LEGACY = [kind for kind in KINDS if not is_kquant(kind)]


@pytest.mark.parametrize("kind", LEGACY)
def test_the_runs_layout_moves_each_runs_fields_together(kernels, kind: str) -> None:
    """block_runs: each full run of 8 blocks becomes its 8 d, 8 m, 8 qh, then 8 qs (the fields in
    the block's own order), the same bytes in the same span; a row's last blocks stay as they are."""
    cols = 800  # 25 blocks: 3 full runs and 1 block
    raw = _blocks(kind, 3, cols, seed=13)
    held = mx.array(raw)
    runs = np.array(kernels.block_runs(held, kind))
    assert np.array_equal(np.array(held), raw)  # an input still held is not rewritten in place
    blocks = raw.reshape(3, 25, -1)
    per_block = blocks.shape[-1]
    for r in range(3):
        for run in range(3):
            group = blocks[r, 8 * run : 8 * run + 8]
            expected = np.concatenate([group[:, span].reshape(-1) for span in FIELDS[kind].values()])
            assert np.array_equal(runs[r, 8 * run * per_block : 8 * (run + 1) * per_block], expected)
        assert np.array_equal(runs[r, 24 * per_block :], blocks[r, 24])


@pytest.mark.parametrize("kind", LEGACY)
def test_the_runs_layout_gives_the_files_results_bit_for_bit(path, kind: str) -> None:
    """Every row count up to 33 (one-row and batch tiles, the float GEMM past 32), every legacy width
    (a last run of 1 to 7 blocks, none), weight-row remainders, on the integer and exact paths: the
    same bits as the file's layout, which the tests above check against the reference."""
    for cols in (*WIDTHS[kind], 256):
        raw = _blocks(kind, 37, cols, seed=cols)
        runs = path.block_runs(mx.array(raw), kind)
        assert np.array_equal(
            np.array(path.block_dequantize(runs, f"{kind}_runs")), np.array(path.block_dequantize(mx.array(raw), kind))
        )
        for rows in (1, 2, 3, 4, 5, 8, 17, 32, 33):
            x = _activations(rows, cols, seed=rows + cols)
            assert np.array_equal(
                np.array(path.block_linear(mx.array(x), runs, f"{kind}_runs")), np.array(_linear(path, x, kind, raw))
            )
