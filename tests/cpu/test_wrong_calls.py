"""Every primitive of the CPU kernels refuses a call that does not fit, with a sentence naming what.

The kernels index raw memory by the shapes they are given, so a wrong one (a value pool smaller
than the key pool, a block size other than the pool's, K = 0) read or wrote past a buffer, or
divided by zero and killed the process. Shapes and dtypes are checked where the call enters C++
(a ValueError as the graph is built); what only the inputs' contents tell (block ids, context
lengths, query starts) is checked in the kernel's task before it reads a row, and comes out of
`mx.eval` as a RuntimeError. Each case starts from a call that works and changes one thing.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from baselm import cpu
from tests.cpu.conftest import off_the_main_thread, requires_kernels

pytestmark = requires_kernels

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 16, 4, 2, 64


def _attention_args(**changes) -> dict:
    """One sequence of 20 tokens (2 blocks), its last one queried, over float32 pools of 4 blocks."""
    pool = mx.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    args = dict(
        queries=mx.zeros((1, HEADS, HEAD_DIM)),
        key_parts=[pool],
        value_parts=[pool],
        block_tables=mx.array([[3, 1]], dtype=mx.int32),
        context_lens=mx.array([20], dtype=mx.int32),
        query_starts=mx.array([0, 1], dtype=mx.int32),
        block_size=BLOCK_SIZE,
        scale=0.125,
        softcap=None,
        window=None,
        bits=0,
        group_size=0,
    )
    return {**args, **changes}


def _q8_pool(num_blocks: int = NUM_BLOCKS, scales_dtype: mx.Dtype = mx.float16) -> list[mx.array]:
    lead = (num_blocks, BLOCK_SIZE, KV_HEADS)
    codes = mx.zeros((*lead, HEAD_DIM * 8 // 32), dtype=mx.uint32)
    return [codes, mx.zeros((*lead, HEAD_DIM // 32), dtype=scales_dtype), mx.zeros((*lead, 2), dtype=scales_dtype)]


POOL = mx.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
WRONG_ATTENTION = {
    "block_size other than the pool's": dict(block_size=32),
    "block_size 0": dict(block_size=0),
    "a value pool one block smaller": dict(value_parts=[POOL[:-1]]),
    "a value pool of float16": dict(value_parts=[POOL.astype(mx.float16)]),
    "an int32 pool": dict(key_parts=[POOL.astype(mx.int32)], value_parts=[POOL.astype(mx.int32)]),
    "a pool of 0 KV heads": dict(key_parts=[POOL[:, :, :0]], value_parts=[POOL[:, :, :0]]),
    "a pool of no blocks": dict(key_parts=[POOL[:0]], value_parts=[POOL[:0]]),
    "3 heads over 2 KV heads": dict(queries=mx.zeros((1, 3, HEAD_DIM))),
    "head_dim 0": dict(queries=mx.zeros((1, HEADS, 0))),
    "float16 queries": dict(queries=mx.zeros((1, HEADS, HEAD_DIM), dtype=mx.float16)),
    "int64 block tables": dict(block_tables=mx.array([[3, 1]], dtype=mx.int64)),
    "one query start too few": dict(query_starts=mx.array([0], dtype=mx.int32)),
    "bits 2": dict(key_parts=_q8_pool(), value_parts=_q8_pool(), bits=2, group_size=32),
    "q8 pools with a group size that does not divide head_dim": dict(
        key_parts=_q8_pool(), value_parts=_q8_pool(), bits=8, group_size=48
    ),
    "q8 value scales of one block fewer": dict(
        key_parts=_q8_pool(), value_parts=[_q8_pool()[0], *_q8_pool(NUM_BLOCKS - 1)[1:]], bits=8, group_size=32
    ),
    "q8 scales of int32": dict(
        key_parts=_q8_pool(scales_dtype=mx.int32), value_parts=_q8_pool(scales_dtype=mx.int32), bits=8, group_size=32
    ),
    "q8 key scales of float16, value scales of float32": dict(
        key_parts=_q8_pool(), value_parts=_q8_pool(scales_dtype=mx.float32), bits=8, group_size=32
    ),
}


def test_a_right_attention_call_runs():
    for changes in ({}, dict(key_parts=_q8_pool(), value_parts=_q8_pool(), bits=8, group_size=32)):
        out = cpu.kernels.paged_attention(**_attention_args(**changes))
        mx.eval(out)
        assert out.shape == (1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("why", list(WRONG_ATTENTION))
def test_a_wrong_attention_call_is_a_value_error_before_any_work(why: str):
    with pytest.raises(ValueError, match="paged_attention: "):
        cpu.kernels.paged_attention(**_attention_args(**WRONG_ATTENTION[why]))


WRONG_INDICES = {
    "a block id past the pool": (dict(block_tables=mx.array([[3, 4]], dtype=mx.int32)), r"\[0\]\[1\] is 4, outside"),
    "a negative block id": (dict(block_tables=mx.array([[-1, 1]], dtype=mx.int32)), r"\[0\]\[0\] is -1, outside"),
    "a context past the block table": (dict(context_lens=mx.array([33], dtype=mx.int32)), "context length 33"),
    "more query rows than context": (
        dict(queries=mx.zeros((3, HEADS, HEAD_DIM)), context_lens=mx.array([2], dtype=mx.int32),
             query_starts=mx.array([0, 3], dtype=mx.int32)),
        "3 query rows and context length 2",
    ),
    "query starts past the query rows": (dict(query_starts=mx.array([0, 2], dtype=mx.int32)), "query_starts must lie"),
    "query starts descending": (dict(query_starts=mx.array([1, 0], dtype=mx.int32)), "-1 query rows"),
}  # fmt: skip


@pytest.mark.parametrize("why", list(WRONG_INDICES))
def test_indices_outside_their_arrays_fail_the_evaluation_before_a_row_is_read(why: str):
    changes, message = WRONG_INDICES[why]
    args = _attention_args(**changes)
    mx.eval([value for value in args.values() if isinstance(value, mx.array)], args["key_parts"], args["value_parts"])
    with pytest.raises(RuntimeError, match=message):  # inputs made here, the failing call on a thread of its own
        off_the_main_thread(lambda: mx.eval(cpu.kernels.paged_attention(**args)))


@pytest.mark.parametrize(
    "pool, rows, slots",
    [
        (POOL[0], mx.zeros((2, KV_HEADS, HEAD_DIM)), mx.array([0, 1], dtype=mx.int32)),  # a 3-D pool
        (POOL, mx.zeros((2, 1, HEAD_DIM)), mx.array([0, 1], dtype=mx.int32)),  # rows of another KV head count
        (POOL, mx.zeros((2, KV_HEADS, HEAD_DIM), dtype=mx.float16), mx.array([0, 1], dtype=mx.int32)),
        (POOL, mx.zeros((2, KV_HEADS, HEAD_DIM)), mx.array([0.0, 1.0])),  # float32 slots
        (POOL, mx.zeros((2, KV_HEADS, HEAD_DIM)), mx.array([0], dtype=mx.int32)),  # a slot per row missing
    ],
    ids=["pool_3d", "rows_kv_heads", "rows_dtype", "slots_dtype", "slots_count"],
)
def test_a_wrong_pool_write_is_a_value_error(pool: mx.array, rows: mx.array, slots: mx.array):
    with pytest.raises(ValueError, match="write_pool: "):
        cpu.kernels.write_pool(pool, rows, slots)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k: k.rms_norm(mx.zeros((2, 0)), mx.zeros((0,)), 1e-5), "rms_norm: weight must be"),
        (lambda k: k.rms_norm(mx.zeros((2, 8)), mx.zeros((4,)), 1e-5), "rms_norm: weight must be"),
        (lambda k: k.rms_norm(mx.zeros((2, 8), dtype=mx.float16), mx.zeros((8,)), 1e-5), "rms_norm: x and weight"),
        (lambda k: k.gated_activation(mx.zeros((2, 0)), "silu"), "gated_activation: gate_up"),
        (lambda k: k.gated_activation(mx.zeros((2, 7)), "silu"), "gated_activation: gate_up"),
        (lambda k: k.gated_activation(mx.zeros((2, 8)), "relu"), "gated_activation: act"),
        (lambda k: k.rope(mx.zeros((2, 1, 8)), mx.array([0, 1], dtype=mx.int32), mx.ones((4,)), 16, False),
         "rope: dims"),
        (lambda k: k.rope(mx.zeros((2, 1, 8)), mx.array([0], dtype=mx.int32), mx.ones((4,)), 8, False),
         "rope: positions"),
        (lambda k: k.rope(mx.zeros((2, 1, 8)), mx.array([0, 1], dtype=mx.int32), mx.ones((3,)), 8, False),
         "rope: freqs"),
    ],
    ids=["norm_d0", "norm_weight", "norm_dtype", "gated_n0", "gated_odd", "gated_act", "rope_dims", "rope_positions",
         "rope_freqs"],
)  # fmt: skip
def test_a_wrong_fused_op_call_is_a_value_error(call, message: str):
    with pytest.raises(ValueError, match=message):
        call(cpu.kernels)


def _codes(n: int, k: int, bits: int) -> mx.array:
    return mx.zeros((n, k * bits // 32), dtype=mx.uint32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k: k.dense_linear(mx.zeros((2, 0)), mx.zeros((3, 0))), "dense_linear: x must have a last axis K >= 1"),
        (lambda k: k.dense_linear(mx.zeros((2, 8)), mx.zeros((3, 4))), "dense_linear: w must be"),
        (lambda k: k.dense_linear(mx.zeros((2, 8)), mx.zeros((3, 8)), mx.zeros((2,))), "dense_linear: bias"),
        (lambda k: k.affine_linear(mx.zeros((2, 0)), _codes(3, 0, 4), mx.zeros((3, 0)), mx.zeros((3, 0)), 32, 4),
         "affine_linear: x must have a last axis K >= 1"),
        (lambda k: k.affine_linear(mx.zeros((2, 48)), _codes(3, 48, 4), mx.zeros((3, 1)), mx.zeros((3, 1)), 32, 4),
         "affine_linear: K must be a multiple of group_size"),
        (lambda k: k.affine_linear(mx.zeros((2, 64)), _codes(3, 32, 4), mx.zeros((3, 2)), mx.zeros((3, 2)), 32, 4),
         "affine_linear: codes"),
        (lambda k: k.affine_linear(mx.zeros((2, 64)), _codes(3, 64, 4), mx.zeros((2, 2)), mx.zeros((3, 2)), 32, 4),
         "affine_linear: scales and biases"),
        (lambda k: k.affine_linear(mx.zeros((2, 64)), _codes(3, 64, 4), mx.zeros((3, 2)),
                                   mx.zeros((3, 2), dtype=mx.float16), 32, 4), "affine_linear: scales and biases"),
    ],
    ids=["dense_k0", "dense_w", "dense_bias", "affine_k0", "affine_group", "affine_codes", "affine_scales",
         "affine_dtypes"],
)  # fmt: skip
def test_a_wrong_linear_call_is_a_value_error(call, message: str):
    with pytest.raises(ValueError, match=message):
        call(cpu.kernels)


HIDDEN, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM, INTER = 32, 2, 1, 16, 32


def _layer_args(**changes) -> dict:
    """One layer of float32 weights over pools of 4 blocks of 16, a step of one token at position 19."""
    pool = mx.zeros((NUM_BLOCKS, BLOCK_SIZE, LAYER_KV_HEADS, LAYER_HEAD_DIM))
    qkv = (LAYER_HEADS + 2 * LAYER_KV_HEADS) * LAYER_HEAD_DIM
    args = dict(
        x=mx.zeros((1, HIDDEN)),
        positions=mx.array([19], dtype=mx.int32),
        slot_mapping=mx.array([BLOCK_SIZE + 3], dtype=mx.int32),
        block_tables=mx.array([[3, 1]], dtype=mx.int32),
        context_lens=mx.array([20], dtype=mx.int32),
        query_starts=mx.array([0, 1], dtype=mx.int32),
        key_pool=pool,
        value_pool=pool,
        norms=[mx.ones((HIDDEN,)), mx.ones((HIDDEN,))],
        linears=[[mx.zeros((qkv, HIDDEN))], [mx.zeros((HIDDEN, LAYER_HEADS * LAYER_HEAD_DIM))],
                 [mx.zeros((2 * INTER, HIDDEN))], [mx.zeros((HIDDEN, INTER))]],
        bits=[0, 0, 0, 0],
        group_sizes=[0, 0, 0, 0],
        freqs=None,
        rope_dims=0,
        traditional=False,
        mscale=1.0,
        num_heads=LAYER_HEADS,
        scale=0.25,
        softcap=None,
        window=None,
        eps=1e-5,
        act="silu",
    )  # fmt: skip
    return {**args, **changes}


LAYER_POOL = mx.zeros((NUM_BLOCKS, BLOCK_SIZE, LAYER_KV_HEADS, LAYER_HEAD_DIM))
WRONG_LAYER = {
    "a value pool one block smaller": dict(value_pool=LAYER_POOL[:-1]),
    "a value pool of float16": dict(value_pool=LAYER_POOL.astype(mx.float16)),
    "pools of no blocks": dict(key_pool=LAYER_POOL[:0], value_pool=LAYER_POOL[:0]),
    "pools of blocks of no rows": dict(key_pool=LAYER_POOL[:, :0], value_pool=LAYER_POOL[:, :0]),
    "0 heads": dict(num_heads=0),
    "hidden 0": dict(x=mx.zeros((1, 0))),
    "3 projections": dict(linears=_layer_args()["linears"][:3]),
    "slots of another count": dict(slot_mapping=mx.array([0, 1], dtype=mx.int32)),
}


def test_a_right_layer_call_runs():
    out, keys, values = cpu.kernels.decoder_layer(**_layer_args())
    mx.eval(out, keys, values)
    assert out.shape == (1, HIDDEN)


@pytest.mark.parametrize("why", list(WRONG_LAYER))
def test_a_wrong_layer_call_is_a_value_error_before_any_work(why: str):
    with pytest.raises(ValueError, match="decoder_layer: "):
        cpu.kernels.decoder_layer(**_layer_args(**WRONG_LAYER[why]))


def test_a_layer_step_naming_a_block_past_the_pool_fails_its_evaluation():
    def step() -> None:
        out, _, _ = cpu.kernels.decoder_layer(**_layer_args(block_tables=mx.array([[3, 9]], dtype=mx.int32)))
        mx.eval(out)

    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[1\] is 9, outside the pool's 4 blocks"):
        off_the_main_thread(step)
