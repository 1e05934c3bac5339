"""The kernel wrappers refuse calls whose shapes do not fit together, before anything is launched.

A Metal kernel indexes its buffers by the shapes it is given (block size, pool rows, heads), so a
call with a value pool smaller than its key pool, or blocks of another size than the metadata's,
reads and writes past them. Each wrong call here must be one ValueError naming what is wrong;
the runner fails the test if a launch is attempted. No GPU or compiler needed.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from metal_cases import build, call_of, case_named

from baselm.metal import AttentionCall, KVWrite
from baselm.metal.kernels import paged_attention_kernel, quantize_rows_kernel, write_kv_kernel
from baselm.metal.kv_quant import QuantizedPool, allocate_pool
from baselm.metal.launch import Launch


def never_run(launch: Launch) -> list[mx.array]:
    raise AssertionError(f"{launch.kernel.name} was launched for a call that should have been refused")


def _smaller(pool):
    """The same pool with one block fewer."""
    if isinstance(pool, QuantizedPool):
        return pool._replace(codes=pool.codes[:-1], scales=pool.scales[:-1], biases=pool.biases[:-1])
    return pool[:-1]


def _wrong_calls() -> dict[str, AttentionCall]:
    call = call_of(case_named("decode_only_mha_d64"))  # float32, 4 heads of 64, 4 KV heads, blocks of 16
    q8 = call_of(case_named("q8_pool_gqa_d128"))
    queries, key_pool, value_pool, meta = build(case_named("mixed_gqa3_d80_bs8"))  # blocks of 8
    return {
        "a value pool one block smaller": dataclasses.replace(call, value_pool=_smaller(call.value_pool)),
        "a value pool of another dtype": dataclasses.replace(call, value_pool=call.value_pool.astype(mx.float16)),
        "a float value pool beside a quantized key pool": dataclasses.replace(
            q8, value_pool=mx.zeros(q8.key_pool.shape)
        ),
        "quantized scales of another shape": dataclasses.replace(
            q8, key_pool=q8.key_pool._replace(scales=q8.key_pool.scales[..., :1])
        ),
        "pools of blocks of 8 for metadata of 16": dataclasses.replace(call, key_pool=key_pool, value_pool=key_pool),
        "queries of another head_dim": dataclasses.replace(call, queries=call.queries[..., :32]),
        "3 heads over 4 KV heads": dataclasses.replace(call, queries=call.queries[:, :3]),
        "fewer query rows than the step": dataclasses.replace(call, queries=call.queries[:-1]),
        "2-D queries": dataclasses.replace(call, queries=call.queries[0]),
        "sinks of another length": dataclasses.replace(call, sinks=mx.zeros((3,))),
    }


@pytest.mark.parametrize("why", list(_wrong_calls()))
def test_a_wrong_attention_call_is_refused_before_the_kernel_runs(why: str):
    call = _wrong_calls()[why]
    with pytest.raises(ValueError, match="paged attention: "):
        paged_attention_kernel(call, run=never_run)


def _write(**changes) -> KVWrite:
    pool = allocate_pool(3, 8, 2, 64, mx.float16, 8)
    rows = mx.zeros((4, 2, 64), dtype=mx.float16)
    write = KVWrite(pool, pool, rows, rows, mx.array([17, 3, 8, 23], dtype=mx.int32))
    return dataclasses.replace(write, **changes)


@pytest.mark.parametrize(
    "why, write",
    [
        ("keys of another KV head count", _write(keys=mx.zeros((4, 1, 64), dtype=mx.float16))),
        ("values of another head_dim", _write(values=mx.zeros((4, 2, 32), dtype=mx.float16))),
        ("int64 slots", _write(slot_mapping=mx.array([17, 3, 8, 23], dtype=mx.int64))),
        ("fewer slots than rows", _write(slot_mapping=mx.array([17, 3], dtype=mx.int32))),
        ("a value pool of 4 bits", _write(value_pool=allocate_pool(3, 8, 2, 64, mx.float16, 4))),
    ],
)
def test_a_wrong_kv_write_is_refused_before_the_kernel_runs(why: str, write: KVWrite):
    with pytest.raises(ValueError, match="KV write: "):
        write_kv_kernel(write, run=never_run)


@pytest.mark.parametrize("bits, group_size, head_dim", [(3, 32, 64), (4, 0, 64), (4, 48, 64), (8, 2, 64)])
def test_rows_the_quantize_kernel_cannot_group_are_refused(bits: int, group_size: int, head_dim: int):
    rows = mx.zeros((2, 1, head_dim), dtype=mx.float16)
    with pytest.raises(ValueError, match="KV quantization: "):
        quantize_rows_kernel(rows, bits, group_size, mx.float16, run=never_run)


def test_a_right_call_passes_its_check():
    for name in ("decode_only_mha_d64", "q4_pool_d80_group16", "sinks_gqa_window"):
        call_of(case_named(name)).check()
    _write().check()
