"""Whole experts per rank, in one process: each rank's part of an MoE layer, summed, is the layer."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from baselm.distributed.tp.layers import Sharding
from baselm.distributed.tp.moe import RankExperts, expert_range
from baselm.models import build_model
from baselm.models.base import ModelConfigError
from baselm.models.moe import QuantizedSwitchLinear
from baselm.store import hf
from tests.distributed.moe_fixtures import WIDENED_EXPERTS, widened_experts
from tests.distributed.tp_ranks import MOE_FIXTURES, quantized
from tests.paths import MODEL_FIXTURES


def _weights(name: str, bits: int | None) -> tuple[dict, dict]:
    if bits is None:
        return hf.read_config(MODEL_FIXTURES / name), hf.read_weights(MODEL_FIXTURES / name)
    config, weights = widened_experts(MODEL_FIXTURES / name, WIDENED_EXPERTS[name])
    return config, quantized(weights, bits=bits)


def _build(name: str, bits: int | None, size: int) -> tuple[dict, object, list]:
    """(config, the whole model, each of `size` ranks' model with whole experts per rank)."""
    config, weights = _weights(name, bits)
    is_quantized = bits is not None or name.endswith("mxfp4")  # MXFP4 experts come quantized
    whole = build_model(config, dict(weights), keep_quantized=is_quantized)
    ranks = [
        build_model(config, dict(weights), keep_quantized=is_quantized, shard=Sharding(r, size, moe_split="experts"))
        for r in range(size)
    ]
    return config, whole, ranks


# Quantized in groups of 32, the fixtures' attention splits over two ranks, not four.
CASES = [(name, None, size) for name in MOE_FIXTURES for size in (2, 4)]
CASES += [("mixtral", 4, 2), ("qwen3_moe_sparse", 8, 2), ("gpt_oss_mxfp4", None, 2)]


@pytest.mark.parametrize(("name", "bits", "size"), CASES)
def test_the_ranks_parts_of_an_moe_layer_add_up_to_the_whole_layer(name, bits, size):
    config, whole, ranks = _build(name, bits, size)
    x = mx.random.normal((9, config["hidden_size"]), key=mx.random.key(3))  # (num_tokens, hidden)
    num_checked = 0
    for i, layer in enumerate(whole.layers):
        if not hasattr(layer.mlp, "route"):  # a dense layer (Qwen3-MoE's mlp_only_layers)
            assert all(not isinstance(m.layers[i].mlp.inner, RankExperts) for m in ranks)
            continue
        parts = [m.layers[i].mlp.inner for m in ranks]  # each rank's part, before the all_sum
        assert all(isinstance(p, RankExperts) for p in parts)
        num_experts = layer.mlp.experts.down_proj.weight.shape[0]
        assert [p.first for p in parts] == [r * num_experts // size for r in range(size)]
        assert all(p.moe.experts.down_proj.weight.shape[0] == num_experts // size for p in parts)
        if bits is not None or name.endswith("mxfp4"):
            assert all(isinstance(p.moe.experts.down_proj, QuantizedSwitchLinear) for p in parts)
        assert mx.allclose(sum(p(x) for p in parts), layer.mlp(x), atol=1e-5).item(), (name, i)
        num_checked += 1
    assert num_checked >= 1


def test_a_rank_whose_experts_no_token_picked_adds_zeros():
    config, whole, ranks = _build("mixtral", None, 4)  # one expert per rank, two picked per token
    x = mx.random.normal((1, config["hidden_size"]), key=mx.random.key(5))  # (1, hidden)
    parts = [m.layers[0].mlp.inner(x) for m in ranks]
    assert sum(not mx.any(p).item() for p in parts) == 2
    assert mx.allclose(sum(parts), whole.layers[0].mlp(x), atol=1e-5).item()


def test_experts_that_do_not_divide_by_the_ranks_are_refused():
    assert expert_range(8, 1, 4) == (2, 4)
    with pytest.raises(ModelConfigError, match="4 experts cannot be split evenly over 3 ranks"):
        expert_range(4, 0, 3)
    config, weights = _weights("mixtral", None)
    with pytest.raises(ModelConfigError, match="--moe-split intermediate"):
        build_model(config, weights, shard=Sharding(0, 3, moe_split="experts"))


def test_an_unknown_moe_split_is_refused():
    with pytest.raises(ModelConfigError, match="--moe-split must be one of experts, intermediate"):
        Sharding(0, 2, moe_split="rows")


def test_either_split_leaves_each_rank_the_same_share_of_the_expert_weights():
    config, weights = _weights("mixtral", None)
    whole = build_model(config, dict(weights))
    whole_bytes = sum(v.nbytes for _, v in tree_flatten(whole.parameters()))
    expert_bytes = sum(v.nbytes for k, v in tree_flatten(whole.parameters()) if ".experts." in k)
    seen = {}
    for split in ("experts", "intermediate"):
        sharding = Sharding(0, 2, moe_split=split)
        build_model(config, dict(weights), shard=sharding)
        seen[split] = sharding.weight_bytes
    assert seen["experts"] == seen["intermediate"]
    assert seen["experts"] <= whole_bytes - expert_bytes // 2  # half the experts, and half of attention
