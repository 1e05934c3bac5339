"""Whole models on the CPU kernels against the reference path: the fixture architectures in
float32 and affine-quantized, layer swapping and fusing, and SmolLM2's Q4_1 GGUF (slow)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from baselm.backend import Backend
from baselm.loader import load_model
from baselm.models import build_model, cpu_layer
from baselm.models.linear import KernelLinear, KernelQuantizedEmbedding, KernelQuantizedLinear
from baselm.store import hf
from tests.cpu.conftest import requires_kernels
from tests.forward import prefill_logits
from tests.models.test_smollm2 import greedy
from tests.paths import MODEL_FIXTURES

pytestmark = requires_kernels

ARCHS = ["llama", "llama_rope3_mqa", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
IDS = [3, 17, 200, 5, 99, 1, 42, 7, 250, 31, 8]  # 11 tokens: a prefill that is not a power of two


def _quantized(weights: dict[str, mx.array], group_size: int, bits: int) -> dict[str, mx.array]:
    """Every 2-D projection and embedding as an affine triplet with float16 scales (as GGUF files carry)."""
    out = {}
    for name, value in weights.items():
        if name.endswith(".weight") and value.ndim == 2 and "norm" not in name and value.shape[1] % group_size == 0:
            codes, scales, biases = mx.quantize(value, group_size, bits)
            prefix = name.removesuffix(".weight")
            out[name] = codes
            out[prefix + ".scales"] = scales.astype(mx.float16)
            out[prefix + ".biases"] = biases.astype(mx.float16)
        else:
            out[name] = value
    return out


def _max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Worst difference relative to the logits' scale."""
    return float(np.abs(actual - expected).max() / max(1.0, float(np.abs(expected).max())))


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_model_matches_reference(arch: str) -> None:
    folder = MODEL_FIXTURES / arch
    config, weights = hf.read_config(folder), hf.read_weights(folder)
    reference = build_model(config, dict(weights))
    model = build_model(config, dict(weights), cpu_kernels=True)
    assert any(isinstance(m, KernelLinear) for m in model.modules())
    assert _max_error(prefill_logits(model, IDS), prefill_logits(reference, IDS)) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("group_size", "bits"), [(32, 4), (64, 8), (32, 5)])
def test_quantized_model_matches_dequantized_reference(arch: str, group_size: int, bits: int) -> None:
    folder = MODEL_FIXTURES / arch
    config = hf.read_config(folder)
    weights = _quantized(hf.read_weights(folder), group_size, bits)
    reference = build_model(config, dict(weights), keep_quantized=False)  # dequantized to float32
    model = build_model(config, dict(weights), keep_quantized=True, cpu_kernels=True)
    assert any(isinstance(m, KernelQuantizedLinear) for m in model.modules())
    assert _max_error(prefill_logits(model, IDS), prefill_logits(reference, IDS)) < 1e-5


def test_quantized_layers_stay_quantized_and_fuse() -> None:
    folder = MODEL_FIXTURES / "qwen2"  # q/k/v biases and tied embeddings
    config = hf.read_config(folder)
    model = build_model(config, _quantized(hf.read_weights(folder), 32, 4), keep_quantized=True, cpu_kernels=True)
    assert isinstance(model.embed_tokens, KernelQuantizedEmbedding)
    assert model.embed_tokens.scales.dtype == mx.float16  # kept as stored: the kernels widen them
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    (qkv,) = attn._qkv
    (gate_up,) = mlp._gate_up
    assert isinstance(qkv, KernelQuantizedLinear) and "bias" in qkv
    assert qkv.weight.shape[0] == attn.q_proj.weight.shape[0] + 2 * attn.k_proj.weight.shape[0]
    assert gate_up.weight.shape[0] == 2 * mlp.gate_proj.weight.shape[0]
    assert model.dtype == mx.float32  # the activations', not the scales'
    assert not any(type(m) in (nn.Linear, nn.QuantizedLinear) for m in model.modules())


def test_quantized_layer_at_prefill_sizes_and_in_float16() -> None:
    """Prefill-sized inputs stay on the kernel; a float16 input takes MLX's ops on the dequantized weight."""
    mx.random.seed(3)
    w = mx.random.normal((48, 64))
    codes, scales, biases = mx.quantize(w, 32, 4)
    layer = KernelQuantizedLinear(codes, scales.astype(mx.float16), biases.astype(mx.float16), 32, 4, None)
    dense = mx.dequantize(
        codes, scales.astype(mx.float16).astype(mx.float32), biases.astype(mx.float16).astype(mx.float32), 32, 4
    )
    for rows in (1, 65, 200):
        x = mx.random.normal((rows, 64))
        np.testing.assert_allclose(np.array(layer(x)), np.array(x @ dense.T), rtol=1e-5, atol=1e-4)
    half = mx.random.normal((3, 64)).astype(mx.float16)
    assert layer(half).dtype == mx.float16
    np.testing.assert_allclose(np.array(layer(half)), np.array(half @ dense.astype(mx.float16).T), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_smollm2_q4_kernels_match_the_dequantized_float32_path(smollm2_gguf, smollm2_reference, monkeypatch) -> None:
    monkeypatch.setenv("BASE_GGUF_BLOCKS", "0")  # Q4_1 as affine triplets (the file's blocks: test_legacy_block_models)
    kernels = load_model(smollm2_gguf, Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=True))
    reference = load_model(smollm2_gguf, Backend("cpu", mx.float32, keep_quantized=False))
    assert isinstance(kernels.model.layers[0].mlp.down_proj, KernelQuantizedLinear)
    for case in smollm2_reference["cases"][:3]:
        ids = case["prompt_token_ids"]
        assert _max_error(prefill_logits(kernels.model, ids), prefill_logits(reference.model, ids)) < 1e-5


@pytest.mark.slow
def test_smollm2_q4_decode_steps_match_the_dequantized_float32_path(smollm2_gguf, smollm2_reference) -> None:
    # One-row steps: the decoder layer runs as one kernel call on the quantized weights.
    kernels = load_model(smollm2_gguf, Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=True))
    reference = load_model(smollm2_gguf, Backend("cpu", mx.float32, keep_quantized=False))
    assert cpu_layer.plan_for(kernels.model.layers[0]) is not None
    ids = smollm2_reference["cases"][0]["prompt_token_ids"]
    _, got = greedy(kernels.model, ids, 12)
    _, expected = greedy(reference.model, ids, 12)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert _max_error(np.array(a), np.array(b)) < 1e-5, step
