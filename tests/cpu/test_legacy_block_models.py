"""GGUF files with legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) run with their matrices kept as blocks
on the CPU kernels: the layers a file gets, by default and as BASE_GGUF_BLOCKS says; a llama mixing
every legacy type with K-quants against the same file's values run in float32 (the gguf package's
decode), on the exact and the integer paths; a pulled `.base` file against the GGUF; and SmolLM2's
real file (Q4_1 body, Q8_0 tied embeddings), whose greedy tokens on the exact path are transformers'
and on the integer path are the same up to the first near-tie."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu, gguf_blocks
from baselm.backend import Backend
from baselm.loader import load_model
from baselm.models.base import ModelConfigError
from baselm.models.linear import BlockEmbedding, BlockLinear
from baselm.store.base_reader import BaseFile
from tests.cpu.conftest import requires_kernels
from tests.forward import exact_path, prefill_logits
from tests.store.test_gguf_kquants import k_quant_llama
from tests.tiny_gguf import oracle

pytestmark = requires_kernels
KERNELS = Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=True)
FLOAT = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.arange(3, 19)
NEAR_TIE = 0.05  # as tests/cpu/test_fast_path_models.py

# Every legacy type beside two K-quants in one llama (GGUF stem -> rows, type), as a Qwen2.5 Q4_K_M
# file mixes Q5_0, Q8_0, Q4_K and Q6_K; the tied-style head is Q8_0.
MIXED = {
    "token_embd": (256, "Q8_0"),
    "blk.0.attn_q": (256, "Q5_0"),
    "blk.0.attn_k": (128, "Q5_1"),
    "blk.0.attn_v": (128, "Q8_0"),
    "blk.0.attn_output": (256, "Q4_0"),
    "blk.0.ffn_gate": (256, "Q4_1"),
    "blk.0.ffn_up": (256, "Q4_K"),
    "blk.0.ffn_down": (256, "Q6_K"),
    "output": (256, "Q8_0"),
}
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # version 3 (IQ4_NL, version 4: test_low_bit_block_models)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the mixed llama, the same values as F32 tensors)."""
    folder = tmp_path_factory.mktemp("legacy")
    path = k_quant_llama(folder / "mixed.gguf", stems=MIXED)
    values = {name: (v.astype(np.float32), "F32") for name, v in oracle(path).items()}
    return path, k_quant_llama(folder / "values.gguf", values, stems=MIXED)


def _kinds(model) -> dict[str, str]:
    """The block layers of a model: module path -> its blocks' kind."""
    return {name: m.kind for name, m in model.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}


ALL_KINDS = {
    "embed_tokens": "q8_0",
    "layers.0.self_attn.q_proj": "q5_0",
    "layers.0.self_attn.k_proj": "q5_1",
    "layers.0.self_attn.v_proj": "q8_0",
    "layers.0.self_attn.o_proj": "q4_0",
    "layers.0.mlp.gate_proj": "q4_1",
    "layers.0.mlp.up_proj": "q4_k",
    "layers.0.mlp.down_proj": "q6_k",
    "lm_head": "q8_0",
}


def test_every_block_matrix_becomes_a_block_layer(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "1")
    model = load_model(files[0], KERNELS).model
    assert _kinds(model) == ALL_KINDS
    assert type(model.embed_tokens) is BlockEmbedding


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "integer"])
def test_logits_match_the_values_run_in_float32(files, kernels, monkeypatch, exact: bool) -> None:
    """The exact path agrees to float32 rounding; the integer path to its activation codes: in this
    random model one projection alone on the integer path moves the logits by up to 1.6e-3 of the
    largest (q_proj, o_proj: 1.1e-3 to 1.3e-3; v_proj's Q8_0 blocks 8e-5, its affine form 1.6e-3), and
    those errors add up or cancel (all of them: 2.2e-3; with v_proj affine: 6e-4)."""
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "1")
    with exact_path(kernels, exact):
        kept = prefill_logits(load_model(files[0], KERNELS).model, IDS)
    expected = prefill_logits(load_model(files[1], FLOAT).model, IDS)
    assert np.abs(kept - expected).max() <= (1e-5 if exact else 5e-3) * np.abs(expected).max()


def test_the_default_keeps_the_types_whose_blocks_run_faster_where_the_kernels_have_simd_loops(
    files, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BASE_GGUF_BLOCKS", raising=False)
    monkeypatch.delenv("BASE_KQUANT_BLOCKS", raising=False)
    before = cpu.kernels.isa()
    try:
        for isa in cpu.kernels.supported_isas():
            cpu.kernels.set_isa(isa)
            kept = {name: kind for name, kind in ALL_KINDS.items() if kind.upper() in gguf_blocks.DEFAULT_KEPT}
            assert _kinds(load_model(files[0], KERNELS).model) == ({} if isa == "generic" else kept), isa
    finally:
        cpu.kernels.set_isa(before)


def test_a_list_keeps_the_types_it_names_and_the_rest_load_exactly_as_affine_triplets(
    files, kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "q5_0, Q8_0,q6_k")  # Q6_K's affine form is re-quantized
    before = kernels.exact_setting()
    kernels.set_exact(True)
    try:
        model = load_model(files[0], KERNELS).model
        assert _kinds(model) == {name: kind for name, kind in ALL_KINDS.items() if kind in ("q5_0", "q8_0", "q6_k")}
        expected = prefill_logits(load_model(files[1], FLOAT).model, IDS)
        assert np.abs(prefill_logits(model, IDS) - expected).max() <= 1e-5 * np.abs(expected).max()
    finally:
        kernels.set_exact(before)


def test_the_older_k_quant_setting_turns_only_the_k_quants_off(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASE_GGUF_BLOCKS", raising=False)
    monkeypatch.setenv("BASE_KQUANT_BLOCKS", "0")
    assert gguf_blocks.kept_on_load("avx2") == gguf_blocks.DEFAULT_KEPT - gguf_blocks.KQUANT_TYPES
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "0")  # the general setting wins
    assert _kinds(load_model(files[0], KERNELS).model) == {}


def test_a_setting_that_names_no_block_type_is_a_clear_error(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "q8_0,iq2_xs")
    message = r"^BASE_GGUF_BLOCKS=q8_0,iq2_xs names IQ2_XS, which is not a block type"
    with pytest.raises(ModelConfigError, match=message):
        load_model(files[0], KERNELS)


@pytest.mark.parametrize("setting", ["1", "0"], ids=["blocks", "affine"])
def test_a_pulled_base_file_runs_as_the_gguf_does(files, tmp_path: Path, monkeypatch, setting: str) -> None:
    """`base pull` keeps every block matrix in a version-3 `.base` file: loaded, it gets the layers and
    the logits the GGUF file gets, with blocks kept and with them turned off (converted at load)."""
    from baselm.store.convert import convert

    convert(files[0], tmp_path / "m.base", None, None, "default")
    base = BaseFile.open(tmp_path / "m.base")
    assert base.version == 3
    assert {entry.dtype for entry in base.tensors.values()} >= {f"gguf_{t.lower()}" for t in LEGACY}
    monkeypatch.setenv("BASE_GGUF_BLOCKS", setting)
    direct, pulled = (load_model(path, KERNELS).model for path in (files[0], tmp_path / "m.base"))
    assert _kinds(direct) == _kinds(pulled) == (ALL_KINDS if setting == "1" else {})
    assert np.array_equal(prefill_logits(direct, IDS), prefill_logits(pulled, IDS))


# ---------------------------------------------------------------------------------------------
# SmolLM2's real GGUF: Q4_1 matrices, Q8_0 token embeddings that are also its LM head


@pytest.fixture(scope="module")
def smollm2_blocks(smollm2_gguf):
    """SmolLM2 as `base` runs it on these kernels with every block type kept."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BASE_GGUF_BLOCKS", "1")
        return load_model(smollm2_gguf, KERNELS)


def _until_near_tie(case: dict) -> int:
    margins = case["top2_margin"]
    return next((i for i, margin in enumerate(margins) if margin < NEAR_TIE), len(margins))


@pytest.mark.slow
def test_smollm2_runs_its_q4_1_and_q8_0_blocks_as_they_are(smollm2_blocks) -> None:
    model = smollm2_blocks.model
    kinds = _kinds(model)
    assert type(model.embed_tokens) is BlockEmbedding and kinds.pop("embed_tokens") == "q8_0"
    assert set(kinds.values()) == {"q4_1"} and len(kinds) == 7 * len(model.layers)


@pytest.mark.slow
def test_smollm2_on_blocks_exact_path_gives_transformers_tokens(smollm2_blocks, smollm2_reference, kernels) -> None:
    from tests.models.test_smollm2 import engine_greedy

    before = kernels.exact_setting()
    kernels.set_exact(True)
    try:
        for case in smollm2_reference["cases"]:
            expected = case["generated_token_ids"][:16]
            (tokens,) = engine_greedy(smollm2_blocks, [case["prompt_token_ids"]], len(expected))
            assert tokens == expected, case["prompt"]
    finally:
        kernels.set_exact(before)


@pytest.mark.slow
def test_smollm2_on_blocks_integer_path_gives_them_up_to_the_first_near_tie(
    smollm2_blocks, smollm2_reference, kernels
) -> None:
    from tests.models.test_smollm2 import engine_greedy

    before = kernels.exact_setting()
    kernels.set_exact(False)
    try:
        for case in smollm2_reference["cases"]:
            expected = case["generated_token_ids"][: _until_near_tie(case)]
            (tokens,) = engine_greedy(smollm2_blocks, [case["prompt_token_ids"]], len(expected))
            assert tokens == expected, case["prompt"]
    finally:
        kernels.set_exact(before)
