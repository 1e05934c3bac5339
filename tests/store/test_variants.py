"""Variant names: what a pull tag and the quantization options ask for."""

from __future__ import annotations

import pytest

from baselm.store.errors import StoreError
from baselm.store.hub import Selection
from baselm.store.variants import Plan, plan_variant

SAFETENSORS = Selection("safetensors", ())
GGUF_Q4_K_M = Selection("gguf", (), "Q4_K_M")


@pytest.mark.parametrize(
    ("selection", "tag", "options", "plan"),
    [
        (SAFETENSORS, None, {}, Plan("q4", "q4", "default", None)),
        (SAFETENSORS, "Q8", {}, Plan("q8", "q8", "default", None)),
        (SAFETENSORS, "mixed", {}, Plan("mixed-q4", "q4", "mixed", None)),
        (SAFETENSORS, "mixed-q6", {}, Plan("mixed-q6", "q6", "mixed", None)),
        (SAFETENSORS, None, {"quant": "q3", "group_size": 64}, Plan("q3-g64", "q3", "default", 64)),
        (SAFETENSORS, None, {"profile": "/p/attn-heavy.json"}, Plan("attn-heavy-q4", "q4", "/p/attn-heavy.json", None)),
        (GGUF_Q4_K_M, "Q4_K_M", {}, Plan("q4_k_m", None, "default", None)),
        (GGUF_Q4_K_M, "Q4_K_M", {"quant": "q8"}, Plan("q4_k_m-q8", "q8", "default", None)),
    ],
)
def test_the_variant_name_says_how_the_model_was_stored(
    selection: Selection, tag: str | None, options: dict, plan: Plan
) -> None:
    options = {"quant": None, "profile": None, "group_size": None, **options}
    assert plan_variant(selection, tag, **options) == plan


def test_an_unknown_variant_tag_lists_the_choices() -> None:
    with pytest.raises(
        StoreError,
        match=(
            r"unknown variant 'q9'; use a quantization \(q2, q3, q4, q5, q6, q8, f16, bf16, f32\), a profile "
            r"\(default, mixed\)"
        ),
    ):
        plan_variant(SAFETENSORS, "q9", None, None, None)
