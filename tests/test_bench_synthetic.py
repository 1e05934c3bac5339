"""`base bench --synthetic`: random-weight models of real shapes, built through the real path."""

from __future__ import annotations

import mlx.core as mx
import pytest

from baselm.backend import select_backend
from baselm.commands.bench_synthetic import SHAPES, _matrix_shapes, run_synthetic, synthetic_config, synthetic_weights
from baselm.config import ConfigError


def test_shapes_give_the_parameter_counts_they_are_named_for():
    counts = {size: sum(o * i for o, i in _matrix_shapes(synthetic_config(size)).values()) for size in SHAPES}
    assert 130e6 < counts["135M"] < 140e6
    assert 355e6 < counts["360M"] < 365e6
    assert 1.2e9 < counts["1B"] < 1.3e9


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ConfigError, match="choose from 135M, 360M, 1B"):
        synthetic_config("7B")


def test_weights_are_seeded_and_quantized_as_the_store_keeps_them(monkeypatch):
    monkeypatch.setitem(
        SHAPES,
        "tiny",
        {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5000},
    )  # fmt: skip
    config = synthetic_config("tiny")
    first, again = synthetic_weights(config, 4, seed=1), synthetic_weights(config, 4, seed=1)
    assert mx.array_equal(first["model.embed_tokens.weight"], again["model.embed_tokens.weight"]).item()
    assert first["model.embed_tokens.scales"].dtype == mx.float16
    assert first["model.layers.0.mlp.down_proj.weight"].shape == (64, 96 * 4 // 32)
    dense = synthetic_weights(config, None, seed=1)
    assert dense["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


@pytest.mark.slow
def test_run_reports_decode_speed_beside_the_roofline():
    report = run_synthetic(["135M"], 4, select_backend("cpu"), gen_tokens=4, seed=0)
    (row,) = report["models"]
    assert report["quant"] == "q4" and report["bandwidth_gb_s"] > 0
    assert 70 * 2**20 < row["weight_bytes"] < 90 * 2**20  # 135M weights at 4.5 bits (codes + f16 scales)
    assert row["decode_tok_s"] > 0 and row["roofline_tok_s"] > 0
