"""The whole decoder layer as one CPU kernel call (models/cpu_layer.py) against the per-op path
it replaces: hidden states and both KV pools, over ragged steps, weight formats and layer options."""

from __future__ import annotations

import json
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from baselm.cpu import fused
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.models import build_model, cpu_layer, model_class
from tests.cpu.conftest import requires_kernels
from tests.test_cli import base
from tests.tiny_model import write_model_folder

pytestmark = requires_kernels

BLOCK_SIZE = 4
NUM_BLOCKS = 24

# Odd shapes: GQA 3:1, MQA, head_dim 32/48/64, an intermediate size that is no power of two.
CONFIGS = {
    "llama_gqa": dict(model_type="llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                      intermediate_size=160),
    "llama_mqa_partial_rope": dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=48, intermediate_size=96, partial_rotary_factor=0.5),
    "qwen2_qkv_bias": dict(model_type="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=64, intermediate_size=192),
    "smollm3_no_rope": dict(model_type="smollm3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=96, no_rope_layers=[0]),
    "mistral_window": dict(model_type="mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64, sliding_window=5),
}  # fmt: skip

# (query_lens, context_lens) of a step: decode rows, prompt chunks and both mixed.
STEPS = {
    "one_decode": ([1], [9]),
    "three_decodes": ([1, 1, 1], [1, 13, 4]),
    "four_decodes_on_block_edges": ([1, 1, 1, 1], [4, 8, 5, 16]),
    "chunk_of_5": ([5], [11]),
    "mixed": ([1, 7, 1, 2], [20, 7, 3, 12]),
    "chunk_of_17_and_a_decode": ([17, 1], [30, 2]),
    "chunk_of_32": ([32], [40]),
}


@pytest.fixture
def restore_enabled() -> Iterator[None]:
    before = fused.layer_enabled
    yield
    fused.layer_enabled = before


def _config(name: str) -> dict:
    base = dict(vocab_size=64, num_hidden_layers=1, rms_norm_eps=1e-5, max_position_embeddings=256)
    return {**base, **CONFIGS[name]}


def _weights(config: dict, seed: int) -> dict[str, mx.array]:
    """Seeded random weights in the HF names the model reads, with norm weights away from 1."""
    mx.random.seed(seed)
    args_cls, model_cls = model_class(config["model_type"])
    model = model_cls(args_cls.from_dict(config))
    weights = {f"model.{k}": v for k, v in nn.utils.tree_flatten(model.parameters())}
    rng = np.random.default_rng(seed)
    for name, value in weights.items():
        if "norm" in name or name.endswith(".bias"):
            weights[name] = mx.array(rng.uniform(0.5, 1.5, value.shape).astype(np.float32))
    return weights


def _quantized(weights: dict[str, mx.array], formats: dict[str, tuple[int, int]]) -> dict[str, mx.array]:
    """Projections whose name contains a key of `formats` as affine (group_size, bits) triplets with float16
    scales, where the input width is a multiple of the group."""
    out = dict(weights)
    for name, value in weights.items():
        fmt = next((f for key, f in formats.items() if key in name), None)
        if fmt is None or not name.endswith(".weight") or value.ndim != 2 or value.shape[1] % fmt[0]:
            continue  # stays float32: a layer may mix formats
        codes, scales, biases = mx.quantize(value, *fmt)
        prefix = name.removesuffix(".weight")
        out[name], out[prefix + ".scales"], out[prefix + ".biases"] = (
            codes,
            scales.astype(mx.float16),
            biases.astype(mx.float16),
        )
    return out


def _layer(config_name: str, formats: dict[str, tuple[int, int]], seed: int = 0):
    config = _config(config_name)
    weights = _quantized(_weights(config, seed), formats)
    model = build_model(config, weights, keep_quantized=bool(formats), cpu_kernels=True)
    return model, model.layers[0]


def _step(model, query_lens: list[int], context_lens: list[int], seed: int):
    """Metadata (blocks handed out shuffled), pools filled with seeded values, and the step's input."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(NUM_BLOCKS).tolist()
    tables, at = [], 0
    for ctx in context_lens:
        need = -(-ctx // BLOCK_SIZE)
        tables.append(order[at : at + need])
        at += need
    meta = AttentionMetadata.build(tables, query_lens, context_lens, BLOCK_SIZE)
    caches = [PagedKVCache.for_model(model, NUM_BLOCKS, BLOCK_SIZE) for _ in range(2)]
    shape = caches[0][0].keys.shape
    keys = rng.standard_normal(shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    for cache in caches:
        cache[0].keys, cache[0].values = mx.array(keys), mx.array(values)
    x = mx.array(rng.standard_normal((sum(query_lens), model.args.hidden_size)).astype(np.float32))
    return meta, caches, x


def _compare(model, layer, query_lens, context_lens, seed=1, atol=1e-5) -> None:
    """The kernel's layer against the per-op path; `atol` relative to the largest output (random
    K-quant blocks make outputs of 1e5, where float32 sums in another order differ in units)."""
    meta, (ref_cache, cache), x = _step(model, query_lens, context_lens, seed)
    fused.layer_enabled = False
    expected = layer(x, meta.positions, meta, ref_cache[0])
    mx.eval(expected, ref_cache[0].keys, ref_cache[0].values)
    fused.layer_enabled = True
    got = cpu_layer.decoder_layer(layer, x, meta.positions, meta, cache[0])
    assert got is not None, "the fused layer should apply"
    np.testing.assert_allclose(
        np.array(got), np.array(expected), rtol=1e-5, atol=atol * max(1.0, float(np.abs(np.array(expected)).max()))
    )
    np.testing.assert_allclose(np.array(cache[0].keys), np.array(ref_cache[0].keys), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.array(cache[0].values), np.array(ref_cache[0].values))


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("step", STEPS)
def test_float32_layer_matches_the_per_op_path(kernels, restore_enabled, config_name, step):
    model, layer = _layer(config_name, {})
    _compare(model, layer, *STEPS[step])


@pytest.mark.parametrize("config_name", ["llama_gqa", "qwen2_qkv_bias"])
@pytest.mark.parametrize(
    "formats",
    [
        {"proj": (32, 4)},
        {"proj": (64, 8)},
        {"proj": (32, 5)},  # no register path: decoded through the scratch rows
        {"q_proj": (32, 4), "k_proj": (32, 4), "v_proj": (32, 4), "gate_proj": (32, 8), "up_proj": (32, 8)},
    ],
    ids=["q4_g32", "q8_g64", "q5_g32", "mixed_float_o_and_down"],
)
@pytest.mark.parametrize("step", ["one_decode", "four_decodes_on_block_edges", "mixed", "chunk_of_17_and_a_decode"])
def test_quantized_layer_matches_the_per_op_path(kernels, restore_enabled, config_name, formats, step):
    model, layer = _layer(config_name, formats)
    _compare(model, layer, *STEPS[step])


def test_every_row_count_from_1_to_32_matches(restore_enabled):
    model, layer = _layer("llama_gqa", {"proj": (32, 4)})
    for num_rows in range(1, 33):
        _compare(model, layer, [num_rows], [num_rows + 3], seed=num_rows)


def test_slots_outside_the_pool_are_not_written(restore_enabled):
    model, layer = _layer("llama_gqa", {})
    meta, (_, cache), x = _step(model, [2], [6], seed=3)
    meta.slot_mapping = mx.array([-1, NUM_BLOCKS * BLOCK_SIZE], dtype=mx.int32)
    keys_before = np.array(cache[0].keys)
    assert cpu_layer.decoder_layer(layer, x, meta.positions, meta, cache[0]) is not None
    np.testing.assert_array_equal(np.array(cache[0].keys), keys_before)


@pytest.mark.parametrize(
    "case",
    ["rows_over_the_limit", "quantized_pools", "qk_norm_layer", "disabled"],
)
def test_the_per_op_path_serves_what_the_kernel_does_not(restore_enabled, case):
    config_name = "llama_gqa"
    if case == "qk_norm_layer":
        CONFIGS["qwen3_norms"] = dict(CONFIGS["llama_gqa"], model_type="qwen3")
        config_name = "qwen3_norms"
    try:
        model, layer = _layer(config_name, {})
    finally:
        CONFIGS.pop("qwen3_norms", None)
    rows = cpu_layer.LAYER_MAX_ROWS + 1 if case == "rows_over_the_limit" else 1
    meta, (_, cache), x = _step(model, [rows], [rows + 2], seed=4)
    if case == "quantized_pools":
        cache = PagedKVCache.for_model(model, NUM_BLOCKS, BLOCK_SIZE, kv_bits=8)
    fused.layer_enabled = case != "disabled"
    assert cpu_layer.decoder_layer(layer, x, meta.positions, meta, cache[0]) is None


def test_bad_inputs_get_a_clear_error(kernels):
    model, layer = _layer("llama_gqa", {})
    meta, (_, cache), x = _step(model, [1], [5], seed=5)
    plan = dict(cpu_layer.plan_for(layer))
    args = [x, meta.positions, meta.slot_mapping, meta.block_tables, meta.context_lens]
    starts = mx.array([0, 1], dtype=mx.int32)
    with pytest.raises(ValueError, match="pools must be float32"):
        kernels.decoder_layer(*args, starts, cache[0].keys.astype(mx.float16), cache[0].values, **plan)
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.decoder_layer(x.astype(mx.float16), *args[1:], starts, cache[0].keys, cache[0].values, **plan)
    plan["linears"] = plan["linears"][:3]
    with pytest.raises(ValueError, match="qkv, o, gate_up and down"):
        kernels.decoder_layer(*args, starts, cache[0].keys, cache[0].values, **plan)


def _address(a: mx.array) -> int:
    view = np.asarray(memoryview(a))
    address = view.__array_interface__["data"][0]
    del view  # a view left alive would hold a reference and stop the next write from going in place
    return address


def test_the_pools_are_written_in_place(restore_enabled):
    model, layer = _layer("llama_gqa", {"proj": (32, 4)})
    meta, (_, cache), x = _step(model, [1], [9], seed=2)
    before = (_address(cache[0].keys), _address(cache[0].values))
    for _ in range(2):
        assert cpu_layer.decoder_layer(layer, x, meta.positions, meta, cache[0]) is not None
        mx.eval(cache[0].keys, cache[0].values)
        assert (_address(cache[0].keys), _address(cache[0].values)) == before


def test_bench_compares_decode_with_the_layer_kernel_on_and_off(tmp_path):
    folder = write_model_folder(tmp_path / "tiny", eos=False)
    result = base(
        "bench", str(folder), "--json", "--device", "cpu", "--concurrency", "1", "--prompt-tokens", "8",
        "--gen-tokens", "4", "--kv-memory", "8MiB", "--compare-cpu-layer",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["cpu_layer"]
    assert report["rounds"] == 4
    assert report["decode_tok_s_on"] > 0 and report["decode_tok_s_off"] > 0
    assert report["forward_ms_on"] > 0 and report["forward_ms_off"] > 0
    assert report["paired_ratio"] > 0


@pytest.mark.parametrize(
    "formats",
    [
        {"proj": (32, 5)},
        {
            **{name: (32, 5) for name in ("q_proj", "k_proj", "v_proj")},
            **{"o_proj": (64, 6), "gate_proj": (32, 3), "up_proj": (32, 3), "down_proj": (128, 2)},
        },
    ],
    ids=["q5_g32", "mixed_widths"],
)
@pytest.mark.parametrize("step", ["one_decode", "mixed", "chunk_of_17_and_a_decode"])
def test_integer_activations_in_the_layer_match_the_per_op_path(kernels, restore_enabled, formats, step):
    """The one-node layer and the per-op path on the integer path (the CPU default), every weight
    width in one layer: both run the same quantized products, so they agree as on the exact path."""
    before = kernels.exact_setting()
    kernels.set_exact(False)
    try:
        model, layer = _layer("llama_gqa", formats)
        _compare(model, layer, *STEPS[step])
    finally:
        kernels.set_exact(before)


@pytest.mark.parametrize(
    "formats",
    [
        {"q_proj": (32, 4), "k_proj": (32, 4), "v_proj": (32, 8), "gate_proj": (32, 4), "up_proj": (64, 6)},
        {"q_proj": (32, 4), "up_proj": (32, 8)},  # q quantized, k and v float; gate float
    ],
    ids=["v_and_up_of_another_width", "float_and_quantized_pieces"],
)
@pytest.mark.parametrize("step", ["one_decode", "mixed"])
def test_projections_that_do_not_fuse_run_as_pieces(kernels, restore_enabled, formats, step):
    """q/k/v or gate/up of different formats stay apart; the kernel runs each and stacks their columns."""
    model, layer = _layer("llama_gqa", formats)
    assert "_qkv" not in vars(layer.self_attn) and "_gate_up" not in vars(layer.mlp)
    _compare(model, layer, *STEPS[step])


K_LAYER = dict(model_type="qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               intermediate_size=512)  # fmt: skip
# GGUF block mixes, o float: Q4_K_M-like (q/k and gate Q4_K, v and down Q6_K, up Q5_K), and one of
# every legacy type (Qwen2.5's Q4_K_M file has q/k/v Q5_0 beside Q8_0 or Q6_K).
BLOCK_FORMATS = {
    "k_quants": {"q_proj": "q4_k", "k_proj": "q4_k", "v_proj": "q6_k", "gate_proj": "q4_k", "up_proj": "q5_k",
                 "down_proj": "q6_k"},
    "legacy": {"q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "q8_0", "gate_proj": "q4_0", "up_proj": "q4_1",
               "down_proj": "q5_1"},
}  # fmt: skip


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "integer"])
@pytest.mark.parametrize("step", ["one_decode", "three_decodes", "chunk_of_17_and_a_decode"])
@pytest.mark.parametrize("formats", list(BLOCK_FORMATS))
def test_a_block_layer_matches_the_per_op_path(kernels, restore_enabled, exact, step, formats):
    """GGUF blocks kept as they are (baselm/gguf_blocks.py) in the one-node layer."""
    from baselm.models.linear import BlockLinear
    from tests.tiny_gguf import random_blocks

    CONFIGS["qwen2_k"] = K_LAYER
    try:
        config = _config("qwen2_k")
    finally:
        CONFIGS.pop("qwen2_k")
    weights = _weights(config, seed=0)
    for seed, (proj, kind) in enumerate(BLOCK_FORMATS[formats].items()):
        prefix = next(n for n in weights if n.endswith(f"{proj}.weight")).removesuffix(".weight")
        rows, cols = weights.pop(f"{prefix}.weight").shape
        weights[f"{prefix}.{kind}"] = mx.array(random_blocks(kind.upper(), rows, cols, seed))
    before = kernels.exact_setting()
    kernels.set_exact(exact)
    try:
        model = build_model(config, weights, cpu_kernels=True)
        layer = model.layers[0]
        assert type(layer.self_attn.v_proj) is BlockLinear and "_qkv" not in vars(layer.self_attn)
        # Integer path: a last-bit difference upstream can move an activation code by one unit (1/32767 of its block).
        _compare(model, layer, *STEPS[step], atol=1e-6 if exact else 1e-5)
    finally:
        kernels.set_exact(before)
