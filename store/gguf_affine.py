"""A GGUF quantized matrix in the forms the loader takes without its blocks: MLX arrays of a record
(`record_arrays`) and the exact or re-quantized affine triplet of a block type (`affine_record`,
`blocks_as_triplets`), for the paths that run no block kernel (GPU, sharded, adapters).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from baselm import gguf_blocks
from baselm.store.base_writer import TensorRecord
from baselm.store.gguf_iquants import IQ4_TYPES, iq4_record
from baselm.store.gguf_kquants import K_SCHEMES, RequantError, is_exact, k_record, requantized_record
from baselm.store.gguf_quants import EXACT_TYPES, exact_record

log = logging.getLogger(__name__)


def record_arrays(name: str, record: TensorRecord) -> dict[str, mx.array]:
    """A record as MLX arrays: `{name: values}`, a quantized triplet under `.weight`/`.scales`/`.biases`,
    or blocks under their suffix (`x.q8_0`)."""
    if record.block_type is not None:
        return {f"{name.removesuffix('.weight')}.{record.block_type.suffix}": mx.array(record.data)}
    if record.bits is None:
        value = mx.array(record.data)
        return {name: value.view(mx.bfloat16) if record.dtype == "bf16" else value}
    scales, biases = mx.array(record.scales), mx.array(record.biases)
    if record.scale_dtype == "bf16":
        scales, biases = scales.view(mx.bfloat16), biases.view(mx.bfloat16)
    prefix = name.removesuffix(".weight")
    return {name: mx.array(record.codes), f"{prefix}.scales": scales, f"{prefix}.biases": biases}


def affine_form(type_name: str) -> tuple[int, bool]:
    """(bits, whether exact) of the `base_q{bits}` record a quantized GGUF type becomes without blocks."""
    if type_name in EXACT_TYPES:
        return EXACT_TYPES[type_name].bits, True
    if type_name in IQ4_TYPES:
        return 8, True
    return K_SCHEMES[type_name][0], is_exact(type_name)


def affine_record(
    type_name: str, raw: np.ndarray, shape: tuple[int, int], name: str, errors: dict[str, RequantError]
) -> TensorRecord:
    """A quantized GGUF matrix's bytes (rows, row bytes) as an affine record: exact for Q4_0 ... Q8_0,
    Q3_K/Q4_K/Q5_K and IQ4_NL/IQ4_XS, re-quantized for Q2_K/Q6_K (the error added to `errors[type_name]`)."""
    if type_name in EXACT_TYPES:
        return exact_record(type_name, raw, shape)
    if type_name in IQ4_TYPES:
        return iq4_record(type_name, raw, shape)
    if is_exact(type_name):
        return k_record(type_name, raw, shape)
    error = errors.setdefault(type_name, RequantError(type_name, K_SCHEMES[type_name][0]))
    return requantized_record(name, raw, shape, error)


def blocks_as_triplets(weights: dict[str, mx.array], keep: frozenset[str] = frozenset()) -> None:
    """Replaces each kept block matrix of `weights` (`x.q8_0`, `x.q4_k` ..., baselm/gguf_blocks.py) whose
    GGUF type is not in `keep` by what a read without blocks gives: an exact affine triplet (Q4_0 ... Q8_0,
    IQ4_NL, Q3_K, Q4_K, Q5_K, IQ4_XS) or a re-quantized one (Q6_K at 8 bits, Q2_K at 4), the error logged.
    For the paths that run no block kernel (GPU, sharded, adapters) and the types that run faster so."""
    errors: dict[str, RequantError] = {}
    for name in list(weights):
        split = gguf_blocks.split_name(name)
        if split is None or split[1].gguf_type in keep:
            continue
        prefix, block_type = split
        blocks = np.array(weights.pop(name))
        shape = (blocks.shape[0], gguf_blocks.in_features(block_type.dtype, blocks.shape[1]))
        record = affine_record(block_type.gguf_type, blocks, shape, prefix, errors)
        weights.update(record_arrays(f"{prefix}.weight", record))
    for error in errors.values():
        log.warning("%s", error.describe())
