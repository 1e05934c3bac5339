"""Paged attention on the CPU: the compiled kernel where it applies, else `baselm.metal.paged_attention`.

The kernel (csrc/attention*.cpp) computes the reference's maths (metal/reference.py) for any
mix of decode rows and prompt chunks in one step: one work item per sequence, KV head and
tile of query rows, an online softmax over the context in 16-key chunks, GQA by sharing each
key chunk between the query heads of its KV head, tanh soft-capping, sliding windows, and
float32/float16/bfloat16 or q8/q4 (kv_quant.py) pools read in place through the block tables.

It serves a call when MLX runs on the CPU, the kernels module is built and on
(`BASE_CPU_KERNELS` not "0"), the queries are float32 and head_dim is a multiple of 16.
Every other call goes to `baselm.metal.paged_attention` (the Metal kernel on an Apple GPU,
else the pure-MLX reference), so the choice per backend is made here, once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from baselm import cpu, metal
from baselm.metal import AttentionCall, AttentionMetadata, KVWrite
from baselm.metal.kv_quant import Pool, QuantizedPool

_POOL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def kernel_applies(queries: mx.array, key_pool: Pool) -> bool:
    """Whether the CPU kernel serves attention of these queries over this pool."""
    if mx.default_device() != mx.cpu or cpu.kernels is None:
        return False
    return queries.dtype == mx.float32 and queries.shape[-1] % 16 == 0 and key_pool.dtype in _POOL_DTYPES


def paged_attention(call: AttentionCall) -> mx.array:
    """Attention of the flattened queries (num_tokens, heads, head_dim) over the paged K/V of `call.meta`.

    Returns (num_tokens, heads, head_dim): the CPU kernel's result where it applies, else the
    Metal kernel's or the reference's. Attention sinks (gpt-oss: one learned logit per head) are
    not in the CPU kernel, nor are queries that see past their own position (`meta.attend_until`:
    Gemma 3's image tokens): such layers and steps take the other path.
    """
    key_pool, meta = call.key_pool, call.meta
    if call.sinks is not None or meta.attend_until is not None or not kernel_applies(call.queries, key_pool):
        return metal.paged_attention(call)
    bits, group_size = (key_pool.bits, key_pool.group_size) if isinstance(key_pool, QuantizedPool) else (0, 0)
    return cpu.kernels.paged_attention(
        call.queries,
        _parts(key_pool),
        _parts(call.value_pool),
        meta.block_tables,
        meta.context_lens,
        query_starts(meta),
        meta.block_size,
        float(call.scale),
        None if call.softcap is None else float(call.softcap),
        call.window,
        bits,
        group_size,
    )


def write_kv(write: KVWrite) -> tuple[Pool, Pool]:
    """The pools with the new keys and values at their slots: one CPU kernel call per float pool on
    the CPU (in place when the pool is donated), else `baselm.metal.write_kv`."""
    key_pool, value_pool, slots = write.key_pool, write.value_pool, write.slot_mapping
    plain = not isinstance(key_pool, QuantizedPool) and write.keys.dtype == key_pool.dtype == write.values.dtype
    if not plain or mx.default_device() != mx.cpu or cpu.kernels is None:
        return metal.write_kv(write)
    return cpu.kernels.write_pool(key_pool, write.keys, slots), cpu.kernels.write_pool(value_pool, write.values, slots)


def _parts(pool: Pool) -> list[mx.array]:
    return [pool.codes, pool.scales, pool.biases] if isinstance(pool, QuantizedPool) else [pool]


def query_starts(meta: AttentionMetadata) -> mx.array:
    """(num_seqs + 1,) int32: each sequence's first flattened query row, then the token count.
    Made once per step and shared by the layers through `meta.mask_cache`."""
    starts = meta.mask_cache.get("query_starts")
    if starts is None:
        starts = mx.array(np.concatenate([[0], np.cumsum(meta.query_lens)]).astype(np.int32))
        meta.mask_cache["query_starts"] = starts
    return starts


def attention_kernel_status() -> dict[str, str]:
    """For `base doctor`: the CPU attention kernel's state here."""
    if cpu.kernels is None:
        state = f"off: {cpu.status['reason']}"
    elif mx.default_device() != mx.cpu:
        state = "not used (MLX runs on a GPU)"
    else:
        state = f"used ({cpu.kernels.attention_isa()})"
    return {"cpu paged_attention": state}
