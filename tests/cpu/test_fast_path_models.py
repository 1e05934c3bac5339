"""Whole models on the 8-bit-activation path (the CPU default) against the exact path: greedy
tokens equal to transformers' reference (which the exact path reproduces) up to the first step
whose top-2 logit margin is below 0.05, one stream and batched with chunked prefill."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baselm import cpu
from tests.cpu.conftest import requires_kernels
from tests.models.test_smollm2 import engine_greedy

pytestmark = [pytest.mark.slow, requires_kernels]

NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from baselm.backend import select_backend
    from baselm.loader import load_model

    return load_model(smollm2_gguf, select_backend("cpu"))


@pytest.fixture
def fast() -> Iterator[None]:
    before = cpu.kernels.exact_setting()
    cpu.kernels.set_exact(False)
    yield
    cpu.kernels.set_exact(before)


def _until_near_tie(case: dict) -> int:
    """Steps before the first whose top-2 margin is below NEAR_TIE (all of them if none is)."""
    margins = case["top2_margin"]
    return next((i for i, margin in enumerate(margins) if margin < NEAR_TIE), len(margins))


def test_one_stream_matches_the_reference_up_to_the_first_near_tie(smollm2, smollm2_reference, fast):
    for case in smollm2_reference["cases"]:
        steps = _until_near_tie(case)
        expected = case["generated_token_ids"][:steps]
        (tokens,) = engine_greedy(smollm2, [case["prompt_token_ids"]], len(expected))
        assert tokens == expected, case["prompt"]


def test_batched_chunked_prefill_matches_the_reference_up_to_the_first_near_tie(smollm2, smollm2_reference, fast):
    cases = smollm2_reference["cases"]
    outputs = engine_greedy(smollm2, [c["prompt_token_ids"] for c in cases], 32, max_num_batched_tokens=24)
    for case, tokens in zip(cases, outputs):
        expected = case["generated_token_ids"][: _until_near_tie(case)]
        assert tokens[: len(expected)] == expected, case["prompt"]


def test_a_batch_gives_each_sequence_its_one_stream_tokens(smollm2, smollm2_reference, fast):
    """Batching never changes a greedy answer on the fast path either: activations are quantized
    per row, so a row's logits do not depend on its neighbours. All 8 cases: decode steps of 8 rows,
    which the integer GEMM takes where the ISA has it from fewer rows (block_gemm_min_rows: VNNI),
    against one stream's few-row loops."""
    cases = smollm2_reference["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    together = engine_greedy(smollm2, prompts, 24)
    alone = [engine_greedy(smollm2, [p], 24)[0] for p in prompts]
    assert together == alone
