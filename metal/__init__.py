"""Attention and KV-write kernels: MLX arrays in, MLX arrays out.

Each operation has a pure-MLX reference (the path on CPU and CUDA, and the oracle in
tests) and a Metal kernel behind the same function; see README.md in this folder.
The step they serve is described by `AttentionMetadata`, and each call by one object
(`AttentionCall`, `KVWrite`: calls.py), all defined here so this package imports nothing
from the engine.
"""

from baselm.metal.attention_metadata import AdapterRows, AttentionMetadata
from baselm.metal.calls import AttentionCall, KVWrite
from baselm.metal.dispatch import kernel_status, paged_attention, write_kv
from baselm.metal.kv_quant import Pool, QuantizedPool, allocate_pool
from baselm.metal.reference import paged_attention_reference, write_kv_reference

__all__ = [
    "AdapterRows",
    "AttentionCall",
    "AttentionMetadata",
    "KVWrite",
    "Pool",
    "QuantizedPool",
    "allocate_pool",
    "kernel_status",
    "paged_attention",
    "paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
