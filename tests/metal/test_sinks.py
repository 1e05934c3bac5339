"""Attention sinks (gpt-oss): one learned logit per query head joins each softmax as a key with no value."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_cases import Case, build

from baselm.metal import AttentionCall, dispatch, paged_attention, paged_attention_reference
from baselm.metal.attention_metadata import AttentionMetadata

F32 = mx.float32
CASES = [
    Case("sinks_mixed_gqa3", F32, 64, 6, 2, (1, 5, 7), (30, 12, 7), block_size=8),
    Case("sinks_decode_only", F32, 64, 4, 4, (1, 1), (9, 20)),
    Case("sinks_window", F32, 64, 4, 2, (1, 6), (40, 14), window=6),
    Case("sinks_one_prefill", F32, 32, 4, 1, (11,), (11,), block_size=4),
]
SCALE = 0.125


def sinks_for(num_heads: int) -> mx.array:
    return mx.linspace(-2.0, 3.0, num_heads)  # (heads,)


def expected_attention(
    queries: mx.array, key_pool: mx.array, value_pool: mx.array, meta: AttentionMetadata, sinks: mx.array, window
) -> np.ndarray:
    """The definition, one query row at a time in float64: softmax over [scores, sink], the sink's share dropped."""
    q, kp, vp = (np.array(a, dtype=np.float64) for a in (queries, key_pool, value_pool))
    tables, sinks = np.array(meta.block_tables), np.array(sinks, dtype=np.float64)
    num_heads, group = q.shape[1], q.shape[1] // kp.shape[2]
    out, row = np.zeros_like(q), 0
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        keys = kp[tables[seq]].reshape(-1, kp.shape[2], kp.shape[3])[:ctx]  # (ctx, kv_heads, head_dim)
        values = vp[tables[seq]].reshape(-1, vp.shape[2], vp.shape[3])[:ctx]
        for t in range(q_len):
            pos = ctx - q_len + t
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                scores = keys[first : pos + 1, h // group] @ q[row, h] * SCALE
                weights = np.exp(np.append(scores, sinks[h]) - max(scores.max(), sinks[h]))
                out[row, h] = (weights[:-1] / weights.sum()) @ values[first : pos + 1, h // group]
            row += 1
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_with_sinks_follows_the_definition(case: Case):
    queries, key_pool, value_pool, meta = build(case)
    sinks = sinks_for(case.num_heads)
    call = AttentionCall(queries, key_pool, value_pool, meta, SCALE, window=case.window, sinks=sinks)
    got = paged_attention_reference(call)
    expected = expected_attention(queries, key_pool, value_pool, meta, sinks, case.window)
    assert np.abs(np.array(got) - expected).max() < 2e-5


def test_sinks_change_the_output():
    queries, key_pool, value_pool, meta = build(CASES[0])
    plain = paged_attention_reference(AttentionCall(queries, key_pool, value_pool, meta, SCALE))
    sunk = paged_attention_reference(AttentionCall(queries, key_pool, value_pool, meta, SCALE, sinks=sinks_for(6)))
    assert mx.max(mx.abs(plain - sunk)).item() > 1e-2


def test_mlx_fused_attention_takes_sinks_in_the_same_sense():
    # The reference's GPU branch hands sinks to mx.fast.scaled_dot_product_attention: per query head, as here.
    case = CASES[3]
    queries, key_pool, value_pool, meta = build(case)
    sinks = sinks_for(case.num_heads)
    table = np.array(meta.block_tables)[0]
    keys = key_pool[mx.array(table)].reshape(1, -1, 1, case.head_dim)[:, :11].transpose(0, 2, 1, 3)  # (1, 1, 11, d)
    values = value_pool[mx.array(table)].reshape(1, -1, 1, case.head_dim)[:, :11].transpose(0, 2, 1, 3)
    q = queries[None].transpose(0, 2, 1, 3)  # (1, heads, 11, d)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask="causal", sinks=sinks)
    expected = expected_attention(queries, key_pool, value_pool, meta, sinks, None)
    assert np.abs(np.array(out[0].transpose(1, 0, 2)) - expected).max() < 2e-5


def test_calls_with_sinks_are_their_own_kernel_variant(monkeypatch):
    # Where kernels run, a call with sinks is self-checked as a sinks variant before the kernel serves it.
    variants = []
    monkeypatch.setattr(dispatch, "use_kernel", lambda name, variant, check: variants.append(variant) or False)
    queries, key_pool, value_pool, meta = build(CASES[2])
    sinks = sinks_for(4)
    call = AttentionCall(queries, key_pool, value_pool, meta, SCALE, window=6, sinks=sinks)
    got = paged_attention(call)
    paged_attention(AttentionCall(queries, key_pool, value_pool, meta, SCALE, window=6))
    assert [v[-1] for v in variants] == [True, False]
    expected = paged_attention_reference(call)
    assert mx.array_equal(got, expected)
