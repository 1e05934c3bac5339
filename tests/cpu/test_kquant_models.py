"""A K-quant GGUF run with its Q2_K ... Q6_K matrices kept as blocks (BASE_KQUANT_BLOCKS=0 turns it
off) on the CPU kernels: the layers it gets, and its logits against the same file's values run in
float32 (the gguf package's decode), on the exact and the integer paths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu
from baselm.backend import Backend
from baselm.loader import load_model
from baselm.models.linear import BlockEmbedding, BlockLinear
from tests.cpu.conftest import requires_kernels
from tests.forward import exact_path, prefill_logits
from tests.store.test_gguf_kquants import k_quant_llama
from tests.tiny_gguf import oracle

pytestmark = requires_kernels
KERNELS = Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=True)
FLOAT = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.arange(3, 19)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the K-quant llama, the same values as F32 tensors)."""
    folder = tmp_path_factory.mktemp("kquant")
    path = k_quant_llama(folder / "k.gguf")
    values = {name: (v.astype(np.float32), "F32") for name, v in oracle(path).items()}
    return path, k_quant_llama(folder / "values.gguf", values)


@pytest.fixture
def blocks_kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("BASE_KQUANT_BLOCKS", "1")
    yield


def test_the_k_quant_matrices_become_block_layers(files, blocks_kept) -> None:
    model = load_model(files[0], KERNELS).model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(model.embed_tokens) is BlockEmbedding and model.embed_tokens.kind == "q4_k"
    kinds = {name: getattr(attn, name).kind for name in ("q_proj", "k_proj", "o_proj")}
    assert kinds == {"q_proj": "q4_k", "k_proj": "q5_k", "o_proj": "q6_k"}
    assert [getattr(mlp, n).kind for n in ("gate_proj", "up_proj", "down_proj")] == ["q4_k", "q5_k", "q6_k"]
    assert (attn.v_proj.kind, model.lm_head.kind) == ("q3_k", "q2_k")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "integer"])
def test_logits_match_the_values_run_in_float32(files, blocks_kept, kernels, exact: bool) -> None:
    """Every matrix's blocks against its values. The exact path agrees to float32 rounding; the integer
    path to its activation codes."""
    with exact_path(kernels, exact):
        kept = prefill_logits(load_model(files[0], KERNELS).model, IDS)
    expected = prefill_logits(load_model(files[1], FLOAT).model, IDS)
    assert np.abs(kept - expected).max() <= (1e-5 if exact else 1e-3) * np.abs(expected).max()


def test_blocks_are_the_default_where_the_kernels_have_simd_loops_for_them(
    files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """avx2/avx512 keep them; the generic build's plain loops (a third of the affine form's speed on
    a 1.5B file) get the affine form unless BASE_KQUANT_BLOCKS=1 asks."""
    monkeypatch.delenv("BASE_KQUANT_BLOCKS", raising=False)
    isas = cpu.kernels.supported_isas()
    before = cpu.kernels.isa()
    try:
        for isa in isas:
            cpu.kernels.set_isa(isa)
            model = load_model(files[0], KERNELS).model
            kept = any(isinstance(m, BlockLinear) for _, m in model.named_modules())
            assert kept == (isa != "generic"), isa
        cpu.kernels.set_isa("generic")
        monkeypatch.setenv("BASE_KQUANT_BLOCKS", "1")
        assert any(isinstance(m, BlockLinear) for _, m in load_model(files[0], KERNELS).model.named_modules())
    finally:
        cpu.kernels.set_isa(before)


def test_turned_off_the_file_loads_in_the_affine_form(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_KQUANT_BLOCKS", "0")
    model = load_model(files[0], KERNELS).model
    assert not any(isinstance(m, (BlockLinear, BlockEmbedding)) for _, m in model.named_modules())
    # Its Q6_K and Q2_K matrices are re-quantized then: the logits move by more than the blocks' integer path does.
    expected = prefill_logits(load_model(files[1], FLOAT).model, IDS)
    assert np.abs(prefill_logits(model, IDS) - expected).max() > 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize("setting", ["1", "0"], ids=["blocks", "affine"])
def test_a_pulled_base_file_runs_as_the_gguf_does(files, tmp_path: Path, monkeypatch, setting: str) -> None:
    """`base pull` keeps the blocks in the `.base` file: loaded, it gets the layers and the logits the
    GGUF file gets, with blocks kept and with them turned off (converted at load in both cases)."""
    from baselm.store.convert import convert

    convert(files[0], tmp_path / "k.base", None, None, "default")
    monkeypatch.setenv("BASE_KQUANT_BLOCKS", setting)
    direct, pulled = (load_model(path, KERNELS).model for path in (files[0], tmp_path / "k.base"))
    kinds = [[type(m).__name__ for _, m in model.named_modules()] for model in (direct, pulled)]
    assert kinds[0] == kinds[1] and ("BlockLinear" in kinds[0]) == (setting == "1")
    assert np.array_equal(prefill_logits(direct, IDS), prefill_logits(pulled, IDS))
