"""Configs and checkpoints a model cannot run with fail with one sentence naming the problem."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from baselm.models import build_model, supported_model_types
from baselm.models.base import ModelConfigError
from baselm.store import hf
from tests.paths import MODEL_FIXTURES


def build(
    name: str,
    change: dict | None = None,
    drop: tuple[str, ...] = (),
    weights: dict | None = None,
    rope_freq_factors: mx.array | None = None,
):
    folder = MODEL_FIXTURES / name
    config = {k: v for k, v in {**hf.read_config(folder), **(change or {})}.items() if k not in drop}
    weights = hf.read_weights(folder) if weights is None else weights
    return build_model(config, weights, rope_freq_factors=rope_freq_factors)


def test_all_architectures_are_registered():
    assert supported_model_types() == [
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt_oss",
        "idefics3",
        "llama",
        "mistral",
        "mixtral",
        "phi3",
        "qwen2",
        "qwen2_5_vl",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "smolvlm",
    ]


def test_unknown_model_type_lists_the_supported_ones():
    message = "model_type 'gpt_neox' is not supported; supported: " + ", ".join(supported_model_types())
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build("llama", {"model_type": "gpt_neox"})


@pytest.mark.parametrize(
    "name, change, message",
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "mrope", "rope_theta": 10000.0}},
            "rope type 'mrope' is not supported (supported: default, linear, dynamic, llama3, yarn, longrope)",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}},
            "rope type 'linear' needs 'factor' in the config's rope scaling",
        ),
        ("llama", {"hidden_act": "relu2"}, "activation 'relu2' is not supported"),
        ("llama", {"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        (
            "gemma2",
            {"layer_types": ["sliding_attention", "chunked_attention"]},
            "layer type 'chunked_attention' is not supported (supported: full_attention, sliding_attention)",
        ),
        ("gemma2", {"layer_types": ["full_attention"]}, "layer_types lists 1 layers but num_hidden_layers is 2"),
        ("gemma2", {"sliding_window": None}, "the config has sliding-attention layers but no sliding_window size"),
        (
            "gemma3",
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention is set; only causal (decoder) Gemma 3 models can run",
        ),
        (
            "mixtral",
            {"num_experts_per_tok": 5},
            "num_experts_per_tok (5) must be between 1 and the number of experts (4)",
        ),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0] * 3,
                    "long_factor": [1.0] * 4,
                }
            },
            "longrope short_factor has 3 values, but 8 rotary dims need 4",
        ),
        (
            "phi3",
            {"partial_rotary_factor": 0.3125, "rope_parameters": None},
            "partial_rotary_factor gives 5 rotary dims for head_dim 16; need an even count",
        ),
        ("smollm3", {"no_rope_layers": [1]}, "no_rope_layers lists 1 layers but num_hidden_layers is 4"),
        (
            "smollm3",
            {"no_rope_layers": None, "no_rope_layer_interval": 0},
            "no_rope_layer_interval must be at least 1, got 0",
        ),
        (
            "gpt_oss",
            {"num_experts_per_tok": 0},
            "num_experts_per_tok (0) must be between 1 and num_local_experts (4)",
        ),
    ],
)
def test_config_the_model_cannot_honour_is_refused(name, change, message):
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build(name, change)


def test_missing_config_key_is_named():
    with pytest.raises(ModelConfigError, match=r"^config\.json lacks hidden_size needed by baselm\.models\.qwen2$"):
        build("qwen2", drop=("hidden_size",))


def test_missing_tensor_is_named():
    weights = hf.read_weights(MODEL_FIXTURES / "qwen3")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    message = "checkpoint does not match the architecture: missing layers.1.self_attn.k_norm.weight"
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build("qwen3", weights=weights)


def test_missing_expert_is_named():
    weights = hf.read_weights(MODEL_FIXTURES / "mixtral")
    del weights["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    message = "checkpoint lacks expert tensor layers.0.mlp.experts.3.w2.weight"
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build("mixtral", weights=weights)


def test_tensor_of_the_wrong_shape_is_named():
    with pytest.raises(
        ModelConfigError,
        match=r"^tensor layers\.0\.mlp\.gate_proj\.weight has shape \(64, 64\), the config implies \(80, 64\)$",
    ):
        build("mistral", {"intermediate_size": 80})


def test_rope_freqs_tensor_on_top_of_a_config_rope_scaling_is_refused():
    message = "the checkpoint has a rope_freqs tensor and the config a rope scaling; only one may scale"
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build("llama_rope3_mqa", rope_freq_factors=mx.ones((8,)))


def test_rope_freqs_tensor_of_the_wrong_length_is_refused():
    with pytest.raises(ModelConfigError, match=r"^rope_freqs has 5 factors, but 16 rotary dims need 8$"):
        build("llama", rope_freq_factors=mx.ones((5,)))
