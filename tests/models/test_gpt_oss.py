"""gpt-oss beyond the shared parity tests: attention sinks, and MXFP4 experts as released checkpoints store them.

The `gpt_oss_mxfp4` fixture holds `*_blocks`/`*_scales` expert tensors (HF's layout) and the logits
transformers computes after its own dequantization (tests/tools/make_model_fixtures.py).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from baselm.models import build_model
from baselm.models.base import ModelConfigError
from baselm.store import hf
from tests.models.test_parity import TABLE_A, TOL, max_diff, new_cache, reference, step
from tests.paths import MODEL_FIXTURES

MXFP4 = MODEL_FIXTURES / "gpt_oss_mxfp4"
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def prefill(model) -> mx.array:
    (logits,) = step(model, new_cache(model), [(reference(MXFP4.name)["input_ids"], 0, TABLE_A)])
    return logits


def test_attention_sinks_take_part_of_each_softmax():
    # With every sink at -1e9 the softmax is the plain one: the logits move well past the tolerance.
    folder, ref = MODEL_FIXTURES / "gpt_oss", reference("gpt_oss")
    model = build_model(hf.read_config(folder), hf.read_weights(folder))
    for layer in model.layers:
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) > 100 * TOL


def test_mxfp4_experts_widen_to_exactly_the_values_their_blocks_and_scales_encode():
    # Decoded by hand: byte j of a 16-byte block holds values 2j (low nibble) and 2j + 1 (high nibble)
    # of its 32; each block's value is the E2M1 code times 2 ** (scale - 127).
    tensors = load_file(MXFP4 / "model.safetensors")
    blocks = tensors["model.layers.1.mlp.experts.down_proj_blocks"]  # (experts, hidden, inter / 32, 16)
    scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]  # (experts, hidden, inter / 32)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    expected = FP4_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    model = build_model(hf.read_config(MXFP4), hf.read_weights(MXFP4))
    widened = np.array(model.layers[1].mlp.experts.down_proj.weight)  # (experts, hidden, inter)
    assert np.array_equal(widened, expected.reshape(widened.shape))


def test_mxfp4_experts_kept_quantized_give_transformers_logits():
    # The GPU path: gather_qmm straight over the checkpoint's blocks and scales in MLX's mxfp4 mode.
    model = build_model(hf.read_config(MXFP4), hf.read_weights(MXFP4), keep_quantized=True)
    experts = model.layers[0].mlp.experts.gate_up_proj
    assert (experts.mode, experts.bits, experts.group_size, experts.weight.dtype) == ("mxfp4", 4, 32, mx.uint32)
    assert max_diff(prefill(model), reference(MXFP4.name)["logits"]) < TOL


def test_mxfp4_checkpoint_and_its_dequantized_float_twin_are_one_model():
    # transformers' float experts (gpt_oss fixture layout: (experts, in, out)) made from the blocks.
    weights = hf.read_weights(MXFP4)
    for key in [k for k in weights if k.endswith("_blocks")]:
        stem = key.removesuffix("_blocks")
        blocks, scales = weights.pop(key), weights.pop(stem + "_scales")
        codes = blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)
        dense = mx.dequantize(codes, scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
        weights[stem] = dense.swapaxes(-1, -2)
    model = build_model(hf.read_config(MXFP4), weights)
    assert max_diff(prefill(model), reference(MXFP4.name)["logits"]) < TOL


def test_blocks_that_are_not_mxfp4_are_refused_by_name():
    weights = hf.read_weights(MXFP4)
    key = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    weights[key] = weights[key].astype(mx.float32)
    message = "layers.0.mlp.experts.gate_up_proj_blocks is not an MXFP4 tensor"
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        build_model(hf.read_config(MXFP4), weights)


def test_mxfp4_scales_with_quantization_biases_are_refused():
    weights = hf.read_weights(MXFP4)
    weights["model.layers.0.mlp.experts.down_proj.biases"] = mx.zeros((4, 64, 1))
    with pytest.raises(ModelConfigError, match="has uint8 \\(MXFP4\\) scales and takes no"):
        build_model(hf.read_config(MXFP4), weights)


def test_more_experts_per_token_than_experts_is_refused():
    config = {**hf.read_config(MXFP4), "num_experts_per_tok": 5}
    with pytest.raises(ModelConfigError, match=re.escape("num_experts_per_tok (5) must be between 1 and")):
        build_model(config, hf.read_weights(MXFP4))


def mlx_lm_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The experts as mlx-lm saves gpt-oss: gate_proj/up_proj/down_proj (experts, out, in), each with a .bias,
    MXFP4 ones as uint32 codes and uint8 scales."""
    out = {}
    for key, value in weights.items():
        stem, _, name = key.rpartition(".experts.")
        if not stem:
            out[key] = value
            continue
        proj, _, kind = name.partition("_proj")
        if kind == "":  # HF float: (experts, in, out)
            value, kind = value.swapaxes(1, 2), "weight"
        elif kind == "_blocks":  # (experts, out, in / 32, 16) uint8 -> (experts, out, in / 8) uint32
            value, kind = value.reshape(*value.shape[:2], -1).view(mx.uint32), "weight"
        else:
            kind = kind.removeprefix("_")  # bias, scales
        if proj == "gate_up":  # rows (last axis of a bias) alternate gate, up
            out[f"{stem}.experts.gate_proj.{kind}"], out[f"{stem}.experts.up_proj.{kind}"] = (
                value[:, ::2],
                value[:, 1::2],
            )
        else:
            out[f"{stem}.experts.down_proj.{kind}"] = value
    return out


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_mxfp4"])
def test_experts_split_as_mlx_lm_saves_them_load_as_the_same_model(name: str):
    folder, ref = MODEL_FIXTURES / name, reference(name)
    weights = mlx_lm_layout(hf.read_weights(folder))
    assert "model.layers.0.mlp.experts.gate_proj.bias" in weights
    for keep_quantized in (False, True):
        model = build_model(hf.read_config(folder), weights, keep_quantized=keep_quantized)
        (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
        assert max_diff(logits, ref["logits"]) < TOL


def test_affine_quantized_split_experts_interleave_codes_scales_and_biases_alike():
    # mlx-lm's 8-bit experts: the fused layer computes what the dequantized split weights compute.
    folder, ref = MODEL_FIXTURES / "gpt_oss", reference("gpt_oss")
    quantized, dequantized = mlx_lm_layout(hf.read_weights(folder)), mlx_lm_layout(hf.read_weights(folder))
    for key in [k for k in quantized if ".experts." in k and k.endswith(".weight")]:
        codes, scales, biases = mx.quantize(quantized[key], group_size=32, bits=8)
        stem = key.removesuffix(".weight")
        quantized.update({key: codes, f"{stem}.scales": scales, f"{stem}.biases": biases})
        dequantized[key] = mx.dequantize(codes, scales, biases, group_size=32, bits=8)
    model = build_model(hf.read_config(folder), dequantized)
    (expected,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    for keep_quantized in (False, True):
        model = build_model(hf.read_config(folder), quantized, keep_quantized=keep_quantized)
        (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
        assert max_diff(logits, np.array(expected)) < TOL
    assert 0 < max_diff(expected, ref["logits"]) < 0.1  # 8-bit rounding moves logits, a little
