"""The Metal kernels, run on the CPU under metal/emulator/metal_emu.h, against the MLX references.

Each launch is the one the real wrapper builds (same source, template arguments, grid and
threadgroup); only the runner differs. Needs g++ (C++20).
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from metal_cases import CASES, TOLERANCE, Case, call_of, case_named, max_error
from metal_emulate import EmulatorError, kernel_source, run_launch

from baselm.metal import AttentionCall, KVWrite, dispatch, self_check
from baselm.metal.attention_metadata import AttentionMetadata
from baselm.metal.kernels import ATTENTION_REDUCE, paged_attention_kernel, quantize_rows_kernel, write_kv_kernel
from baselm.metal.kv_quant import allocate_pool, dequantize_rows, quantize_rows
from baselm.metal.launch import KernelSource, Launch
from baselm.metal.reference import paged_attention_reference, write_kv_reference

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the Metal emulator needs g++")


def attend(case: Case, run=run_launch) -> tuple[mx.array, mx.array]:
    call = call_of(case)
    got = paged_attention_kernel(call, num_splits=case.num_splits, run=run)
    return got, paged_attention_reference(call)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(case: Case):
    got, expected = attend(case)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert max_error(got, expected) <= TOLERANCE[case.dtype]


def test_reads_before_a_buffer_start_would_fault_too():
    # Buffers placed right after their front guard page: an index below 0 faults here.
    case = case_named("mixed_gqa3_d80_bs8")
    got, expected = attend(case, run=lambda launch: run_launch(launch, align="start"))
    assert max_error(got, expected) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "bits"), [(mx.float16, 128, 8), (mx.bfloat16, 80, 4), (mx.float32, 64, 4)]
)
def test_quantize_kernel_gives_the_reference_codes(dtype, head_dim, bits):
    rows = (3 * mx.random.normal((5, 2, head_dim), key=mx.random.key(7))).astype(dtype)
    group = 16 if head_dim == 80 else 32
    got = quantize_rows_kernel(rows, bits, group, dtype, run=run_launch)
    expected = quantize_rows(rows, bits, group, dtype)
    assert mx.array_equal(got[1], expected[1]) and mx.array_equal(got[2], expected[2])  # scales, biases
    got_q = dequantize_rows(*got, bits, group).astype(mx.float32)
    expected_q = dequantize_rows(*expected, bits, group).astype(mx.float32)
    # Codes may differ only where a value sits on a rounding tie: never by more than one step.
    step = mx.repeat(expected[1].astype(mx.float32), group, axis=-1)
    assert mx.all(mx.abs(got_q - expected_q) <= step * 1.001 + 1e-6).item()
    assert mx.mean((got[0] == expected[0]).astype(mx.float32)).item() >= 0.99


def test_write_kv_kernel_fills_the_slots_like_the_reference():
    key_pool = allocate_pool(3, 8, 2, 64, mx.float16, 8)
    value_pool = allocate_pool(3, 8, 2, 64, mx.float16, 8)
    keys = mx.random.normal((4, 2, 64), key=mx.random.key(8)).astype(mx.float16)
    values = mx.random.normal((4, 2, 64), key=mx.random.key(9)).astype(mx.float16)
    slots = mx.array([17, 3, 8, 23], dtype=mx.int32)
    got = write_kv_kernel(KVWrite(key_pool, value_pool, keys, values, slots), run=run_launch)
    expected = write_kv_reference(KVWrite(key_pool, value_pool, keys, values, slots))
    for g, e in zip(got, expected):
        assert all(mx.array_equal(a, b).item() for a, b in zip(g[:3], e[:3]))


def variant_call(queries: mx.array, key_pool, window: int | None = None, sinks: mx.array | None = None):
    """An AttentionCall of one decode token: the self-check reads only its kernel variant."""
    meta = AttentionMetadata.build([[0]], [1], [1], key_pool.shape[1])
    return AttentionCall(queries, key_pool, key_pool, meta, 0.125, window=window, sinks=sinks)


def test_self_check_passes_for_a_correct_kernel_and_fails_for_a_wrong_one():
    call = variant_call(mx.zeros((1, 4, 64), dtype=mx.float16), allocate_pool(2, 16, 2, 64, mx.float16, 8))
    self_check.check_attention(call, run=run_launch)

    def off_by_a_little(launch: Launch) -> list[mx.array]:
        return [out * 1.05 for out in run_launch(launch)]

    with pytest.raises(AssertionError, match=r"paged_attention \(\[1, 1\] query tokens, 1 key split\(s\)\)"):
        self_check.check_attention(call, run=off_by_a_little)


def test_self_check_of_a_sinks_variant_catches_a_kernel_that_leaves_the_sinks_out():
    queries, key_pool = mx.zeros((1, 8, 64), dtype=mx.float32), allocate_pool(2, 16, 2, 64, mx.float32, 16)
    call = variant_call(queries, key_pool, window=6, sinks=mx.zeros((8,)))
    self_check.check_attention(call, run=run_launch)

    def without_sinks(launch: Launch) -> list[mx.array]:
        template = [(name, False if name == "SINKS" else value) for name, value in launch.template]
        return run_launch(dataclasses.replace(launch, template=template))

    with pytest.raises(AssertionError, match=r"paged_attention \(\[1, 1\] query tokens, 1 key split\(s\)\)"):
        self_check.check_attention(call, run=without_sinks)


def test_failed_self_check_turns_the_kernel_off_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_failures", {})
    monkeypatch.setattr(dispatch, "_checked", set())

    def broken() -> None:
        raise RuntimeError("Unable to build metal library from source\nerror: use of undeclared identifier")

    assert dispatch.passes_self_check("paged_attention", "variant a", broken) is False
    assert dispatch.passes_self_check("paged_attention", "variant b", lambda: None) is False
    assert dispatch.kernel_status()["paged_attention"] == (
        "failed self-check: Unable to build metal library from source error: use of undeclared identifier"
    )
    assert len([r for r in caplog.records if "failed its self-check" in r.getMessage()]) == 1


# ---------------------------------------------------------------- the emulator itself


def test_generated_signature_follows_mlx():
    # Small inputs bind as `constant`, `<name>_shape` is passed when the body mentions it,
    # and the thread attributes the body names follow the outputs.
    part_o, part_ml = mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 2))
    launch = Launch(
        ATTENTION_REDUCE,
        [part_o, part_ml],
        [("T", mx.float16), ("D", 64)],
        (64, 2, 1),
        (64, 1, 1),
        [(1, 2, 64)],
        [mx.float16],
    )
    text, _, _ = kernel_source(ATTENTION_REDUCE, launch)
    assert text.startswith(
        "template <typename T, int D>\n[[kernel]] void custom_kernel_base_paged_attention_reduce(\n"
        "  const device float* part_o [[buffer(0)]],\n"
        "  const device float* part_ml [[buffer(1)]],\n"
        "  const constant int* part_ml_shape [[buffer(2)]],\n"
        "  device float16_t* out [[buffer(3)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
    )
    instance = "custom_kernel_base_paged_attention_reduce<float16_t, 64>"
    assert text.endswith(f"[[kernel]] decltype({instance}) {instance};\n")


@dataclass(frozen=True)
class InlineKernel(KernelSource):
    text: str = ""

    def source(self) -> str:
        return self.text


def run_inline(body: str, inputs: list[mx.array], outputs: list[tuple[tuple[int, ...], mx.Dtype]], grid, group, **kw):
    kernel = InlineKernel(
        name="emu_probe",
        body="",
        input_names=tuple(f"in{i}" for i in range(len(inputs))),
        output_names=tuple(f"out{i}" for i in range(len(outputs))),
        text=body,
    )
    launch = Launch(kernel, inputs, [("T", mx.float32)], grid, group, [s for s, _ in outputs], [d for _, d in outputs])
    return run_launch(launch, **kw)


def test_barrier_orders_threadgroup_writes_before_reads():
    # Each thread writes its slot, waits, then reads the mirrored slot another thread wrote.
    body = """
    threadgroup float shared[64];
    uint i = thread_position_in_threadgroup.x;
    shared[i] = in0[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out0[thread_position_in_grid.x] = shared[63 - i];
    """
    x = mx.arange(128, dtype=mx.float32)
    (out,) = run_inline(body, [x], [((128,), mx.float32)], (128, 1, 1), (64, 1, 1))
    expected = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)])
    assert np.array_equal(np.array(out), expected)


def test_simd_ops_exchange_values_between_the_32_lanes_of_a_simdgroup():
    body = """
    uint i = thread_position_in_grid.x;
    float x = in0[i];
    out0[i] = simd_sum(x);
    out1[i] = simd_max(x);
    out2[i] = simd_shuffle_xor(x, ushort(1));
    out3[i] = simd_broadcast(x, ushort(31));
    out4[i] = simd_shuffle_down(x, ushort(1));
    """
    x = mx.arange(64, dtype=mx.float32)
    outs = run_inline(body, [x], [((64,), mx.float32)] * 5, (64, 1, 1), (64, 1, 1))
    xs = np.arange(64)
    shifted = np.where(xs % 32 == 31, xs, xs + 1)  # the top lane keeps its own value
    expected = [
        np.repeat([xs[:32].sum(), xs[32:].sum()], 32),
        np.repeat([31, 63], 32),
        xs ^ 1,
        np.repeat([31, 63], 32),
        shifted,
    ]
    for got, want in zip(outs, expected):
        assert np.array_equal(np.array(got), want)


def test_out_of_bounds_read_past_the_end_aborts_the_run():
    body = "out0[thread_position_in_grid.x] = in0[thread_position_in_grid.x + 1];"
    with pytest.raises(EmulatorError, match="out-of-bounds access to buffer 'in0' at byte offset 64"):
        run_inline(body, [mx.zeros((16,))], [((16,), mx.float32)], (16, 1, 1), (16, 1, 1))


def test_out_of_bounds_write_before_the_start_aborts_the_run():
    body = "out0[int(thread_position_in_grid.x) - 1] = in0[thread_position_in_grid.x];"
    with pytest.raises(EmulatorError, match="out-of-bounds access to buffer 'out0' at byte offset -4"):
        run_inline(body, [mx.zeros((16,))], [((16,), mx.float32)], (16, 1, 1), (16, 1, 1), align="start")


def test_barrier_skipped_by_returning_threads_is_reported():
    body = """
    if (thread_position_in_grid.x == 3) { return; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out0[thread_position_in_grid.x] = in0[thread_position_in_grid.x];
    """
    with pytest.raises(EmulatorError, match="returned without reaching it"):
        run_inline(body, [mx.zeros((16,))], [((16,), mx.float32)], (16, 1, 1), (16, 1, 1))
