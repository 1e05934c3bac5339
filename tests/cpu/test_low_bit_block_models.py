"""GGUF files with Q2_K, Q3_K, IQ4_NL and IQ4_XS matrices run with them kept as blocks on the CPU
kernels: the layers a file gets, its logits against the same file's values run in float32 (the gguf
package's decode) on the exact and the integer paths of every instruction set, and a pulled `.base`
file (version 4) against the GGUF, with blocks kept and converted at load (Q3_K, IQ4_NL, IQ4_XS
exactly, Q2_K re-quantized to 4 bits). A llama of random blocks (every code), and llama.cpp's own
files of the same llama (tests/fixtures/low_bit, made by tests/tools/make_low_bit_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from baselm import cpu, gguf_blocks
from baselm.backend import Backend
from baselm.loader import load_model
from baselm.models.linear import BlockEmbedding, BlockLinear
from baselm.store.base_reader import BaseFile, read_base_file
from baselm.store.gguf import GGUFFile
from tests.cpu.conftest import requires_kernels
from tests.forward import exact_path, prefill_logits
from tests.paths import FIXTURES
from tests.store.test_gguf_kquants import K_TENSORS, k_quant_llama
from tests.tiny_gguf import oracle, same_bits

pytestmark = requires_kernels
KERNELS = Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=True)
FLOAT = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.arange(3, 19)
# Of the largest logit: these models measured 5e-5 to 9e-5 on the integer path (16-bit activation
# codes), under 7e-7 on the exact one, on avx2 and generic.
INTEGER_RTOL = 5e-4

# Each of the four types in two or three places of one llama (GGUF stem -> rows, type); the head Q2_K,
# as llama.cpp's Q2_K files have it.
LOW_BIT = {
    "token_embd": (256, "IQ4_NL"),
    "blk.0.attn_q": (256, "Q3_K"),
    "blk.0.attn_k": (128, "IQ4_XS"),
    "blk.0.attn_v": (128, "Q2_K"),
    "blk.0.attn_output": (256, "IQ4_NL"),
    "blk.0.ffn_gate": (256, "Q2_K"),
    "blk.0.ffn_up": (256, "IQ4_XS"),
    "blk.0.ffn_down": (256, "Q3_K"),
    "output": (256, "Q2_K"),
}
ALL_KINDS = {
    "embed_tokens": "iq4_nl",
    "layers.0.self_attn.q_proj": "q3_k",
    "layers.0.self_attn.k_proj": "iq4_xs",
    "layers.0.self_attn.v_proj": "q2_k",
    "layers.0.self_attn.o_proj": "iq4_nl",
    "layers.0.mlp.gate_proj": "q2_k",
    "layers.0.mlp.up_proj": "iq4_xs",
    "layers.0.mlp.down_proj": "q3_k",
    "lm_head": "q2_k",
}

# HF name -> GGUF stem of the matrices a pull stores in the file's row order.
UNPERMUTED = {
    "model.embed_tokens": "token_embd",
    "model.layers.0.self_attn.v_proj": "blk.0.attn_v",
    "model.layers.0.self_attn.o_proj": "blk.0.attn_output",
    "model.layers.0.mlp.gate_proj": "blk.0.ffn_gate",
    "model.layers.0.mlp.up_proj": "blk.0.ffn_up",
    "model.layers.0.mlp.down_proj": "blk.0.ffn_down",
    "lm_head": "output",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the low-bit llama, the same values as F32 tensors)."""
    folder = tmp_path_factory.mktemp("low_bit")
    path = k_quant_llama(folder / "low.gguf", stems=LOW_BIT)
    values = {name: (v.astype(np.float32), "F32") for name, v in oracle(path).items()}
    return path, k_quant_llama(folder / "values.gguf", values, stems=LOW_BIT)


def _kinds(model) -> dict[str, str]:
    return {name: m.kind for name, m in model.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}


def test_every_low_bit_matrix_becomes_a_block_layer(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "1")
    model = load_model(files[0], KERNELS).model
    assert _kinds(model) == ALL_KINDS
    assert type(model.embed_tokens) is BlockEmbedding


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "integer"])
def test_logits_match_the_values_run_in_float32(files, kernels, monkeypatch, exact: bool) -> None:
    """The exact path agrees to float32 rounding; the integer path to its 16-bit activation codes (INTEGER_RTOL)."""
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "1")
    with exact_path(kernels, exact):
        kept = prefill_logits(load_model(files[0], KERNELS).model, IDS)
    expected = prefill_logits(load_model(files[1], FLOAT).model, IDS)
    assert np.abs(kept - expected).max() <= (1e-5 if exact else INTEGER_RTOL) * np.abs(expected).max()


def test_the_default_keeps_the_types_that_run_as_blocks_by_default_where_the_kernels_have_simd_loops(
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


def test_a_list_keeps_the_types_it_names(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "q3_k,IQ4_XS")
    kept = _kinds(load_model(files[0], KERNELS).model)
    assert kept == {name: kind for name, kind in ALL_KINDS.items() if kind in ("q3_k", "iq4_xs")}


@pytest.mark.parametrize("setting", ["1", "0"], ids=["blocks", "affine"])
def test_a_pulled_base_file_keeps_the_blocks_and_runs_as_the_gguf_does(
    files, tmp_path: Path, monkeypatch, setting: str
) -> None:
    """`base pull` keeps every matrix's blocks byte for byte in a version-4 `.base` file; loaded, it gets
    the layers and the logits the GGUF file gets, with blocks kept and converted at load."""
    from baselm.store.convert import convert

    convert(files[0], tmp_path / "m.base", None, None, "default")
    base = BaseFile.open(tmp_path / "m.base")
    assert base.version == 4
    dtypes = {
        name.removesuffix(".weight"): entry.dtype for name, entry in base.tensors.items() if name.endswith("weight")
    }
    expected = {f"model.{name}" if name != "lm_head" else name: f"gguf_{kind}" for name, kind in ALL_KINDS.items()}
    assert {name: dtypes[name] for name in expected} == expected
    raw = {t.name: np.array(t.data).reshape(-1) for t in gguf.GGUFReader(str(files[0])).tensors}
    stored = read_base_file(tmp_path / "m.base")[1]
    for hf_name, stem in UNPERMUTED.items():  # q/k rows are reordered for RoPE; the rest are the file's bytes
        assert np.array_equal(np.array(stored[f"{hf_name}.weight"].data).reshape(-1), raw[f"{stem}.weight"]), hf_name
    monkeypatch.setenv("BASE_GGUF_BLOCKS", setting)
    direct, pulled = (load_model(path, KERNELS).model for path in (files[0], tmp_path / "m.base"))
    assert _kinds(direct) == _kinds(pulled) == (ALL_KINDS if setting == "1" else {})
    assert np.array_equal(prefill_logits(direct, IDS), prefill_logits(pulled, IDS))


# ---------------------------------------------------------------------------------------------
# llama.cpp's own blocks: the llama above quantized by its llama-quantize (head Q6_K in each)

LLAMA_CPP = {path.stem.removeprefix("llama-"): path for path in sorted((FIXTURES / "low_bit").glob("*.gguf"))}
LOW_BIT_TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")


def test_the_llama_cpp_files_hold_the_four_types() -> None:
    held = {name: {info.type_name for info in GGUFFile.open(path).tensors.values()} for name, path in LLAMA_CPP.items()}
    assert held == {
        "IQ4_NL": {"F32", "IQ4_NL", "Q6_K"},
        "IQ4_XS": {"F32", "IQ4_XS", "Q6_K"},
        "Q2_K": {"F32", "Q2_K", "Q3_K", "Q6_K"},
        "Q3_K_S": {"F32", "Q3_K", "Q6_K"},
    }


@pytest.mark.parametrize("name", list(LLAMA_CPP))
def test_llama_cpp_s_blocks_decode_as_the_gguf_package_does(kernels, name: str) -> None:
    gguf_file = GGUFFile.open(LLAMA_CPP[name])
    for info in gguf_file.tensors.values():
        if info.type_name in LOW_BIT_TYPES:
            block_type = gguf_blocks.BY_GGUF_TYPE[info.type_name]
            raw = gguf_file.raw(info).reshape(info.shape[0], -1)
            decoded = np.array(kernels.block_dequantize(mx.array(raw), block_type.suffix))
            assert same_bits(decoded, gguf_blocks.dequantize(block_type.dtype, raw, info.shape)), info.name


@pytest.fixture(scope="module")
def llama_cpp_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each llama.cpp file's values as F32 tensors."""
    folder = tmp_path_factory.mktemp("llama_cpp_values")
    return {
        name: k_quant_llama(
            folder / f"{name}.gguf", {n: (v.astype(np.float32), "F32") for n, v in oracle(path).items()}
        )
        for name, path in LLAMA_CPP.items()
    }


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "integer"])
@pytest.mark.parametrize("name", list(LLAMA_CPP))
def test_llama_cpp_s_files_run_as_their_values(llama_cpp_values, kernels, monkeypatch, name: str, exact: bool) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "1")
    with exact_path(kernels, exact):
        model = load_model(LLAMA_CPP[name], KERNELS).model
        kept = prefill_logits(model, IDS)
    assert len(_kinds(model)) == len(K_TENSORS)  # every matrix a block layer
    expected = prefill_logits(load_model(llama_cpp_values[name], FLOAT).model, IDS)
    assert np.abs(kept - expected).max() <= (1e-5 if exact else INTEGER_RTOL) * np.abs(expected).max()
