"""The fused CPU kernels (RMSNorm, RoPE, gated activation; LayerNorm and a plain activation for the
vision towers) against the MLX ops they replace."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from baselm import cpu
from baselm.cpu import fused
from baselm.models.gemma2 import GemmaRMSNorm
from baselm.models.mlp import ACTIVATIONS, MLP
from baselm.models.norm import LayerNorm, RMSNorm
from baselm.models.rope import RoPE
from tests.cpu.conftest import requires_kernels

pytestmark = requires_kernels


def normal(*shape: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("shape", [(1, 576), (5, 17), (3, 4, 64), (2, 1)])
def test_rms_norm_matches_mlx(kernels, shape):
    x, w = normal(*shape), normal(shape[-1], seed=1)
    got = kernels.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape
    assert mx.allclose(got, mx.fast.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6).item()


def test_rms_norm_with_a_weight_offset_is_gemmas_norm():
    norm = GemmaRMSNorm(48, eps=1e-6)
    norm.weight = normal(48, seed=2)
    x = normal(7, 48)
    assert mx.allclose(norm(x), mx.fast.rms_norm(x, 1.0 + norm.weight, 1e-6), rtol=1e-5, atol=1e-6).item()


def test_the_model_norm_uses_the_kernel_and_keeps_nn_rmsnorm_parameters():
    norm = RMSNorm(576, eps=1e-5)
    assert set(dict(nn.utils.tree_flatten(norm.parameters()))) == {"weight"}
    x = normal(3, 576)
    assert fused.rms_norm(x, norm.weight, norm.eps) is not None
    assert mx.allclose(norm(x), mx.fast.rms_norm(x, norm.weight, 1e-5), rtol=1e-5, atol=1e-6).item()


ROPES = {
    "default": dict(dims=64, base=100000.0),
    "partial_rotary": dict(dims=32, base=10000.0),
    "traditional": dict(dims=64, base=10000.0, traditional=True),
    "llama3": dict(
        dims=128,
        base=500000.0,
        scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    ),
    "yarn_mscale": dict(
        dims=64,
        base=10000.0,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    ),
}


def reference_rope(rope: RoPE, x: mx.array, positions: mx.array) -> mx.array:
    """The module's MLX path (mx.fast.rope), as it runs without the kernels."""
    out = rope._rotate(x, positions, rope._freqs)
    if rope.mscale != 1.0:
        rotated = out[..., : rope.dims] * rope.mscale
        out = rotated if rope.dims == out.shape[-1] else mx.concatenate([rotated, out[..., rope.dims :]], -1)
    return out


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_matches_mlx_fast_rope(kernels, name):
    options = ROPES[name]
    rope = RoPE(options["dims"], options["base"], options.get("scaling"), options.get("traditional", False))
    head_dim = 64 if options["dims"] <= 64 else 128
    x = normal(6, 3, head_dim)
    positions = mx.array([0, 1, 15, 16, 2047, 4100], dtype=mx.int32)  # block edges, long contexts
    got = kernels.rope(x, positions, rope._freqs, rope.dims, rope.traditional, rope.mscale)
    # cos/sin of angles in the thousands: float32 rounding of the angle itself is ~2e-4
    assert mx.allclose(got, reference_rope(rope, x, positions), rtol=1e-4, atol=5e-4).item()
    assert mx.array_equal(rope(x, positions), got).item()  # the module uses the kernel


def test_longrope_stays_on_mlx():
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 16,
        "long_factor": [2.0] * 16,
        "original_max_position_embeddings": 64,
    }
    rope = RoPE(32, 10000.0, scaling, max_position_embeddings=256)
    x, positions = normal(2, 2, 32), mx.array([3, 100], dtype=mx.int32)
    cpu_out = rope(x, positions)
    assert mx.allclose(cpu_out[1], rope._rotate(x, positions, rope._long_freqs)[1] * rope.mscale, atol=1e-6).item()


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("width", [1536, 37, 1])
def test_gated_activation_matches_mlx(kernels, act, width):
    gate_up = 3 * normal(4, 2 * width)
    got = kernels.gated_activation(gate_up, fused.GATED_ACTIVATIONS[act])
    gate, up = mx.split(gate_up, 2, axis=-1)
    assert mx.allclose(got, ACTIVATIONS[act](gate) * up, rtol=2e-5, atol=2e-6).item()


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("shape", [(4096, 43), (3, 17), (1,)])
def test_activation_matches_mlx(kernels, act, shape):
    x = 3 * normal(*shape)
    got = kernels.activation(x, fused.GATED_ACTIVATIONS[act])
    assert got.shape == x.shape
    assert mx.allclose(got, ACTIVATIONS[act](x), rtol=2e-5, atol=2e-6).item()


@pytest.mark.parametrize("shape", [(4096, 1152), (5, 17), (2, 3, 40), (1, 1)])
def test_layer_norm_matches_mlx(kernels, shape):
    x, w, b = 2 + 3 * normal(*shape), normal(shape[-1], seed=1), normal(shape[-1], seed=2)
    got = kernels.layer_norm(x, w, b, 1e-6)
    assert mx.allclose(got, mx.fast.layer_norm(x, w, b, 1e-6), rtol=1e-5, atol=2e-5).item()
    bare = kernels.layer_norm(x, None, None, 1e-6)
    assert mx.allclose(bare, mx.fast.layer_norm(x, None, None, 1e-6), rtol=1e-5, atol=2e-5).item()


def test_the_model_layer_norm_uses_the_kernel_and_keeps_nn_layernorm_parameters():
    norm = LayerNorm(40, eps=1e-6)
    norm.weight, norm.bias = normal(40, seed=3), normal(40, seed=4)
    assert set(dict(nn.utils.tree_flatten(norm.parameters()))) == {"weight", "bias"}
    x = normal(3, 40)
    assert fused.layer_norm(x, norm.weight, norm.bias, norm.eps) is not None
    assert mx.allclose(norm(x), nn.LayerNorm.__call__(norm, x), rtol=1e-5, atol=1e-5).item()


def test_gated_activation_of_large_inputs_stays_finite(kernels):
    gate_up = mx.array([[-200.0, -90.0, 0.0, 90.0, 200.0] * 4 + [1.0] * 20], dtype=mx.float32)
    got = kernels.gated_activation(gate_up, "silu")
    gate, up = mx.split(gate_up, 2, axis=-1)
    assert mx.allclose(got, nn.silu(gate) * up, atol=1e-6).item()


def test_fused_mlp_runs_the_kernel_and_matches_the_unfused_one():
    mlp = MLP(32, 48)
    mx.eval(mlp.parameters())
    x = normal(3, 32)
    unfused = mlp(x)
    mlp.fuse()
    assert mx.allclose(mlp(x), unfused, rtol=1e-5, atol=1e-6).item()


def test_other_activations_and_dtypes_are_not_taken():
    assert fused.gated_activation(normal(2, 8), "gelu_fast") is None
    assert fused.rms_norm(normal(2, 8).astype(mx.float16), normal(8), 1e-5) is None
    assert fused.activation(normal(2, 8), "gelu_fast") is None
    assert fused.layer_norm(normal(2, 8).astype(mx.bfloat16), None, None, 1e-5) is None


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="weight must be"):
        cpu.kernels.rms_norm(normal(2, 8), normal(7), 1e-5)
    with pytest.raises(ValueError, match="dims must be even"):
        cpu.kernels.rope(normal(2, 2, 8), mx.array([0, 1], dtype=mx.int32), normal(5), 10, False)
    with pytest.raises(ValueError, match="act must be"):
        cpu.kernels.gated_activation(normal(2, 8), "relu")
    with pytest.raises(ValueError, match="act must be"):
        cpu.kernels.activation(normal(2, 8), "relu")
    with pytest.raises(ValueError, match="weight and bias must be"):
        cpu.kernels.layer_norm(normal(2, 8), normal(7), None, 1e-5)
    with pytest.raises(ValueError, match="a bias needs a weight"):
        cpu.kernels.layer_norm(normal(2, 8), None, normal(8), 1e-5)


def test_status_names_the_instruction_set_in_use():
    used = f"used ({cpu.kernels.isa()})"
    assert fused.fused_kernel_status() == {
        "cpu rms_norm/rope/gated activation": used,
        "cpu decoder layer (steps of up to 32 tokens)": used,
    }


def test_status_says_when_the_decoder_layer_kernel_is_switched_off(monkeypatch):
    monkeypatch.setattr(fused, "layer_enabled", False)
    status = fused.fused_kernel_status()
    assert status["cpu decoder layer (steps of up to 32 tokens)"] == "off: BASE_CPU_LAYER=0"
    assert status["cpu rms_norm/rope/gated activation"] == f"used ({cpu.kernels.isa()})"
