"""The many-row product over GGUF blocks (csrc/qgemm_impl.h): from block_gemm_min_rows activation
rows (a prefill, or a decode batch: 6 rows on VNNI, 16 on AVX2), an AVX-512 VNNI build quantizes the
activations to 16-bit codes (activation_bits() 16, the default: dpwssd) or 8-bit ones (8: dpbusd) in
blocks of 32 and multiplies them against each weight block's codes; an AVX2 build does so with
16-bit codes at either setting (maddwd); past qdot_max_rows the generic build (and at any count
the exact path) multiplies float32 activations (gemm_impl.h).

test_block_kernels.py checks every path against its reference (the GEMM's: `reference(top, shift)`,
integer sums exact); here, at both settings, what a prefill relies on besides: a row's result does not
depend on its batch, the error stays within what rounding the activations to codes can cause, and
odd inputs and large weights split across threads.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.cpu.block_layouts import BLOCK, KINDS, parse
from tests.cpu.test_block_kernels import (
    FLOAT_RTOL,
    ODD,
    _activations,
    _blocks,
    _check,
    _linear,
    _values,
    _weights,
    edge_case,
    gemm_codes,
    integer,  # noqa: F401 - the fixture
    reference,
)


@pytest.fixture(params=[16, 8], ids=["16-bit", "8-bit"])
def gemm(integer, request: pytest.FixtureRequest) -> Iterator[object]:  # noqa: F811
    """The kernels on the integer path with activation_bits() at 16, then 8 (restored afterwards)."""
    before = integer.activation_bits()
    integer.set_activation_bits(request.param)
    yield integer
    integer.set_activation_bits(before)


def test_the_gemm_is_where_avx2_is(kernels) -> None:
    assert kernels.integer_gemm() == (kernels.qdot_isa() in ("avx512-vnni", "avx2"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_in_any_batch_the_gemm_takes(gemm, kind: str) -> None:
    """Each row's activations are quantized on their own and each output sums its sub-blocks in one
    order whatever tile the row falls in (VNNI: 8 rows in pairs of lanes or 8 on 256-bit vectors, 16,
    32 or 48; AVX2: 8 or 16): bit for bit in any batch from block_gemm_min_rows rows (the generic
    build's float tiles: past qdot_max_rows)."""
    cols = ODD[kind]
    raw = _weights(kind, 37, cols, seed=20)[0]
    x = _activations(130, cols, seed=20)
    together = np.array(_linear(gemm, x, kind, raw))
    least = gemm.block_gemm_min_rows() if gemm.integer_gemm() else gemm.qdot_max_rows() + 1  # generic: float tiles
    batches = ((0, least), (9, 8), (30, 12), (41, 16), (0, 33), (5, 40), (17, 64), (60, 70), (97, 33), (70, 56))
    for i, rows in batches:
        if rows >= least:
            assert np.array_equal(np.array(_linear(gemm, x[i : i + rows], kind, raw)), together[i : i + rows])


@pytest.mark.parametrize("rows", [8, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_the_error_is_what_rounding_the_activations_allows(gemm, kind: str, rows: int) -> None:
    """Against the float64 product of the decoded weights: within sum |w| * d / 2 (each activation is
    at most half a step d = max|x| / top of its block from its code, gemm_codes) plus float32
    rounding; and (8 bits) much nearer the 8-bit reference than the float product is, so the
    reference checks the quantization. 8 rows: a decode batch (VNNI: the pairs' tile at 16 bits, one
    of 8 lanes at 8); 40: a prefill's tiles."""
    if not gemm.integer_gemm():
        pytest.skip(f"{gemm.qdot_isa()}: no integer GEMM here (the float one is checked in test_block_kernels)")
    if rows < gemm.block_gemm_min_rows():
        pytest.skip(f"{gemm.qdot_isa()}: {rows} rows take the few-row loops (test_block_kernels)")
    top, shift = gemm_codes(gemm, kind)
    cols = ODD[kind]
    raw, fields, values = _weights(kind, 70, cols, seed=21)
    x = _activations(rows, cols, seed=21)
    actual = np.array(_linear(gemm, x, kind, raw), np.float64)
    x64, w64 = x.astype(np.float64), values.astype(np.float64)
    step = np.repeat(np.abs(x64.reshape(rows, -1, BLOCK)).max(-1) / top, BLOCK, axis=1)  # (rows, cols)
    allowed = (step / 2) @ np.abs(w64).T + FLOAT_RTOL * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    assert (np.abs(actual - x64 @ w64.T) / allowed).max() <= 1.0
    expected, bound = reference(x, fields, top, shift)
    kernel_error = (np.abs(actual - expected) / bound).max()
    assert kernel_error <= 1.0
    if top == 127:
        float_error = (np.abs(x64 @ w64.T - expected) / bound).max()
        assert float_error > 1.0 and kernel_error < float_error / 100


@pytest.mark.parametrize("rows", [8, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_zero_blocks_and_extreme_codes_in_the_gemm(gemm, kind: str, rows: int) -> None:
    """edge_case's activation rows, 8 or 40 of them, against the edge weight blocks."""
    weights, x = edge_case(kind, rows, seed=22)
    _check(gemm, x, weights, _linear(gemm, x, kind, weights[0]), kind=kind)


@pytest.mark.parametrize("kind", ["q4_0", "q4_k", "q6_k"])
def test_large_weights_split_across_threads_past_32_rows(gemm, kind: str) -> None:
    """4864 x 1536 (Qwen2.5's MLP) against 40 rows: 16-row groups claimed by every thread (the tiles
    past 48 rows are test_block_kernels' test_past_32_rows_the_gemm)."""
    raw = _blocks(kind, 4864, 1536, seed=23)
    weights = (raw, parse(kind, raw, 1536), _values(kind, raw, 1536))
    x = _activations(40, 1536, seed=40)
    _check(gemm, x, weights, _linear(gemm, x, kind, raw), kind=kind)
