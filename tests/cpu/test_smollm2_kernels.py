"""SmolLM2 with the CPU attention and fused kernels in every layer against transformers' greedy reference.

The batch runs with a small token budget, so prompts are prefilled in chunks over cached
blocks while other sequences decode in the same step: every kernel path of a real step.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from baselm import paged_attention
from baselm.cpu import fused
from baselm.metal.kv_quant import allocate_pool
from tests.cpu.conftest import requires_kernels
from tests.models.test_smollm2 import engine_greedy, greedy

pytestmark = [pytest.mark.slow, requires_kernels]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from baselm.backend import select_backend
    from baselm.loader import load_model

    return load_model(smollm2_gguf, select_backend("cpu"))


def test_the_kernels_serve_this_model(smollm2):
    _, num_kv_heads, head_dim = smollm2.model.kv_shape()
    queries = mx.zeros((1, 9, head_dim))
    assert paged_attention.kernel_applies(queries, allocate_pool(1, 16, num_kv_heads, head_dim, mx.float32))
    assert fused.kernel_applies(queries)


def test_greedy_tokens_match_transformers(smollm2, smollm2_reference):
    for case in smollm2_reference["cases"][:4]:
        expected = case["generated_token_ids"][:16]
        tokens, _ = greedy(smollm2.model, case["prompt_token_ids"], len(expected))
        assert tokens == expected, case["prompt"]


def test_chunked_prefill_beside_decodes_gives_the_reference_tokens(smollm2, smollm2_reference):
    cases = smollm2_reference["cases"]
    outputs = engine_greedy(smollm2, [c["prompt_token_ids"] for c in cases], 16, max_num_batched_tokens=24)
    for case, tokens in zip(cases, outputs):
        expected = case["generated_token_ids"][:16]
        assert tokens[: len(expected)] == expected, case["prompt"]


def test_q8_kv_pools_keep_the_first_8_greedy_tokens(smollm2, smollm2_reference):
    # Quantized K/V moves logits by ~0.1 (a rounding flip of one code shifts a value by a whole
    # step), so only the steps whose top-2 margins exceed that (the first 8, >= 0.08) are exact.
    cases = smollm2_reference["cases"]
    outputs = engine_greedy(smollm2, [c["prompt_token_ids"] for c in cases], 8, kv_bits=8, max_num_batched_tokens=24)
    for case, tokens in zip(cases, outputs):
        assert tokens == case["generated_token_ids"][:8], case["prompt"]


def test_one_stream_decodes_every_reference_case_to_its_end(smollm2, smollm2_reference):
    # Single-stream decode runs each layer as one kernel call (models/cpu_layer.py).
    for case in smollm2_reference["cases"]:
        expected = case["generated_token_ids"]  # a reference may end early, at its eos
        (tokens,) = engine_greedy(smollm2, [case["prompt_token_ids"]], len(expected))
        assert tokens == expected, case["prompt"]
