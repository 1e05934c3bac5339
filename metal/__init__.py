"""Attention and KV-write kernels: MLX arrays in, MLX arrays out.

Each operation has a pure-MLX reference (the path on CPU and CUDA, and the oracle in
tests) and a Metal kernel behind the same function; see README.md in this folder.
"""

from baselm.metal.dispatch import kernel_status
from baselm.metal.kv_quant import QuantizedPool, allocate_pool
from baselm.metal.paged_attention import paged_attention, paged_attention_reference, write_kv, write_kv_reference

__all__ = [
    "QuantizedPool",
    "allocate_pool",
    "kernel_status",
    "paged_attention",
    "paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
