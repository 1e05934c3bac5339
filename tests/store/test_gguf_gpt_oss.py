"""gpt-oss as llama.cpp's converter writes it to GGUF (`gpt-oss`) loads as the HF model.

The converter (its GptOssModel) splits the fused experts into `ffn_gate_exps`/`ffn_up_exps`
(de-interleaving gate and up) and `ffn_down_exps`, transposed to GGUF's (experts, out, in), with
their biases; names the sinks `attn_sinks`, the router `ffn_gate_inp`, the second norm
`post_attention_norm`; and repacks MXFP4 experts into ggml's blocks (exponent byte, then byte j
holding codes j and j + 16). It writes no SwiGLU clamp, so these files mean llama.cpp's clamp of
7: their logits are transformers' for the fixtures under `config_limit7.json` (`logits_limit7`).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from baselm.backend import Backend
from baselm.loader import load_model
from baselm.store import gguf as gguf_store
from baselm.store.base_format import to_float32
from baselm.store.convert import convert
from baselm.store.errors import ModelFileError
from tests.forward import prefill_logits
from tests.paths import MODEL_FIXTURES
from tests.tiny_gguf import GLOBAL_NAMES, LAYER_NAMES, add_hparams, add_word_vocabulary, oracle, write_gguf

TOL = 1e-4
CPU = Backend("cpu", mx.float32, keep_quantized=False)
LAYER = {
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
    "self_attn.sinks": "attn_sinks",
}


def split_experts(prefix: str, weights: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
    """One layer's fused HF experts (`prefix` = blk.{i}) as the converter writes them: F32, or MXFP4 blocks."""
    hf = {k.rsplit(".", 1)[1]: v for k, v in weights.items()}
    out = {
        f"{prefix}.ffn_gate_exps.bias": (hf["gate_up_proj_bias"][:, ::2], "F32"),
        f"{prefix}.ffn_up_exps.bias": (hf["gate_up_proj_bias"][:, 1::2], "F32"),
        f"{prefix}.ffn_down_exps.bias": (hf["down_proj_bias"], "F32"),
    }
    if "gate_up_proj" in hf:  # float: (experts, in, out) -> (experts, out, in), gate and up de-interleaved
        gate_up = hf["gate_up_proj"].swapaxes(1, 2)
        out[f"{prefix}.ffn_gate_exps.weight"] = (gate_up[:, ::2], "F32")
        out[f"{prefix}.ffn_up_exps.weight"] = (gate_up[:, 1::2], "F32")
        out[f"{prefix}.ffn_down_exps.weight"] = (hf["down_proj"].swapaxes(1, 2), "F32")
        return out
    blocks, scales = hf["gate_up_proj_blocks"], hf["gate_up_proj_scales"]  # (experts, 2 * inter, groups, 16)
    out[f"{prefix}.ffn_gate_exps.weight"] = (ggml_mxfp4(blocks[:, ::2], scales[:, ::2]), "MXFP4")
    out[f"{prefix}.ffn_up_exps.weight"] = (ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2]), "MXFP4")
    out[f"{prefix}.ffn_down_exps.weight"] = (ggml_mxfp4(hf["down_proj_blocks"], hf["down_proj_scales"]), "MXFP4")
    return out


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 (byte j: codes 2j, 2j + 1) as ggml blocks (exponent, then byte j: codes j, j + 16)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    raw = np.concatenate([scales[..., None], qs], axis=-1)  # (experts, out, groups, 17)
    return np.ascontiguousarray(raw.reshape(*scales.shape[:2], -1))


def gpt_oss_gguf(path: Path, name: str, drop: str | None = None) -> Path:
    """The fixture `name` as the converter writes it (without tensor `drop`, if given)."""
    folder = MODEL_FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    tensors, experts = {}, {}
    for key, value in sorted(load_file(str(folder / "model.safetensors")).items()):
        stem, kind = (key, "weight") if key.endswith("sinks") else key.rsplit(".", 1)
        if stem in GLOBAL_NAMES:
            tensors[f"{GLOBAL_NAMES[stem]}.{kind}"] = (value, "F32")
        elif ".experts." in key:
            experts.setdefault(key.split(".")[2], {})[key] = value
        else:
            _, _, layer, rest = stem.split(".", 3)
            tensors[f"blk.{layer}.{LAYER[rest]}.{kind}"] = (value, "F32")
    for layer, weights in experts.items():
        tensors.update(split_experts(f"blk.{layer}", weights))
    tensors = {k: (np.ascontiguousarray(v), t) for k, (v, t) in tensors.items() if k != drop}

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, {**config, "rope_parameters": {"rope_theta": config["rope_parameters"]["rope_theta"]}})
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_sliding_window(config["sliding_window"])
        rope = config["rope_parameters"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        add_word_vocabulary(writer, config)

    return write_gguf(path, tensors, metadata, arch="gpt-oss")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: gpt_oss_gguf(folder / f"{name}.gguf", name) for name in ("gpt_oss", "gpt_oss_mxfp4")}


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_mxfp4"])
def test_a_gpt_oss_gguf_gives_transformers_logits_under_llama_cpps_clamp(name: str, ggufs: dict[str, Path]) -> None:
    reference = np.load(MODEL_FIXTURES / name / "reference.npz")
    logits = prefill_logits(load_model(ggufs[name], CPU).model, reference["input_ids"])
    assert np.abs(logits - reference["logits_limit7"]).max() < TOL


def test_the_implied_config_is_the_hf_one_but_for_what_llama_cpp_fixes(ggufs: dict[str, Path]) -> None:
    config = gguf_store.GGUFCheckpoint.open(ggufs["gpt_oss"]).config
    hf = json.loads((MODEL_FIXTURES / "gpt_oss" / "config_limit7.json").read_text())
    keys = ["num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window", "layer_types"]
    keys += ["swiglu_limit", "head_dim", "num_key_value_heads", "attention_bias", "tie_word_embeddings"]
    assert {k: config[k] for k in keys} == {k: hf[k] for k in keys}
    rope = hf["rope_parameters"]
    assert config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": rope["factor"],
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
        "truncate": False,
    }


def test_running_an_mxfp4_gguf_gets_the_hf_checkpoints_blocks_and_scales_byte_for_byte(ggufs: dict[str, Path]):
    _, weights, _ = gguf_store.load_checkpoint(ggufs["gpt_oss_mxfp4"])
    hf = load_file(str(MODEL_FIXTURES / "gpt_oss_mxfp4" / "model.safetensors"))
    for layer in (0, 1):
        for name in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            assert weights[key].dtype == mx.uint8 and np.array_equal(np.array(weights[key]), hf[key]), key


def test_an_mxfp4_gguf_kept_quantized_gives_transformers_logits(ggufs: dict[str, Path]) -> None:
    # The GPU path: the experts stay MXFP4 (gather_qmm in MLX's mxfp4 mode).
    reference = np.load(MODEL_FIXTURES / "gpt_oss_mxfp4" / "reference.npz")
    model = load_model(ggufs["gpt_oss_mxfp4"], Backend("cpu", mx.float32, keep_quantized=True)).model
    assert model.layers[1].mlp.experts.down_proj.mode == "mxfp4"
    logits = prefill_logits(model, reference["input_ids"])
    assert np.abs(logits - reference["logits_limit7"]).max() < TOL


def test_mxfp4_experts_are_read_exactly_as_the_gguf_package_decodes_them(ggufs: dict[str, Path]) -> None:
    expected = oracle(ggufs["gpt_oss_mxfp4"])["blk.1.ffn_down_exps.weight"]  # (experts, hidden, inter)
    records = {n: r for n, _, r in gguf_store.GGUFCheckpoint.open(ggufs["gpt_oss_mxfp4"]).records()}
    down = records["model.layers.1.mlp.experts.down_proj"]  # HF layout: (experts, inter, hidden)
    assert down.dtype == "bf16"
    assert np.array_equal(to_float32(down.data, down.dtype), expected.swapaxes(1, 2))


def test_fused_experts_are_the_hf_checkpoints_tensors(ggufs: dict[str, Path]) -> None:
    records = {n: r for n, _, r in gguf_store.GGUFCheckpoint.open(ggufs["gpt_oss"]).records()}
    hf = load_file(str(MODEL_FIXTURES / "gpt_oss" / "model.safetensors"))
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        key = f"model.layers.0.mlp.experts.{name}"
        assert np.array_equal(records[key].data, hf[key]), name
    assert np.array_equal(records["model.layers.1.self_attn.sinks"].data, hf["model.layers.1.self_attn.sinks"])


def test_pulling_an_mxfp4_gguf_gives_the_model_of_running_it(ggufs: dict[str, Path], tmp_path: Path) -> None:
    # Exact where it is decided: every weight of the pulled file is the GGUF's, bit for bit. The logits
    # are then equal up to float32 rounding: OpenBLAS's small-matrix SGEMM (AVX-512) rounds the same
    # weights and inputs differently from one model object to another (exactly equal under BASE_BLAS=0).
    ids = np.load(MODEL_FIXTURES / "gpt_oss_mxfp4" / "reference.npz")["input_ids"]
    convert(ggufs["gpt_oss_mxfp4"], tmp_path / "g.base", None, None, "default")
    pulled, run = load_model(tmp_path / "g.base", CPU).model, load_model(ggufs["gpt_oss_mxfp4"], CPU).model
    run_weights, pulled_weights = dict(tree_flatten(run.parameters())), dict(tree_flatten(pulled.parameters()))
    assert pulled_weights.keys() == run_weights.keys()
    for name, weight in pulled_weights.items():
        assert weight.dtype == run_weights[name].dtype and mx.array_equal(weight, run_weights[name]).item(), name
    assert str(pulled) == str(run)
    assert np.abs(prefill_logits(pulled, ids) - prefill_logits(run, ids)).max() < 1e-5


def test_gate_experts_without_their_up_half_are_named(tmp_path: Path) -> None:
    path = gpt_oss_gguf(tmp_path / "broken.gguf", "gpt_oss", drop="blk.0.ffn_up_exps.weight")
    with pytest.raises(ModelFileError, match="model.layers.0.mlp.experts.gate_up_proj lacks its gate or up experts"):
        gguf_store.load_checkpoint(path)
