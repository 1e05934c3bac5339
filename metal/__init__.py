"""Attention and KV-write kernels: MLX arrays in, MLX arrays out.

Each operation has a pure-MLX reference (the path on CPU and CUDA, and the oracle in
tests); custom Metal kernels plug in behind the same functions.
"""

from baselm.metal.paged_attention import paged_attention, paged_attention_reference, write_kv, write_kv_reference

__all__ = ["paged_attention", "paged_attention_reference", "write_kv", "write_kv_reference"]
