"""Each architecture computes transformers' logits, through the paged KV cache, in every step shape.

Fixtures (tests/fixtures/models/<name>/, made by tests/tools/make_model_fixtures.py) are tiny random
HF models with the float32 logits transformers (eager attention) computed for them.
"""

from __future__ import annotations

import functools
import json
import re

import mlx.core as mx
import numpy as np
import pytest

from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.models import build_model
from baselm.models.base import DecoderModel, ModelConfigError
from baselm.store import hf
from tests.paths import MODEL_FIXTURES

NAMES = [
    "gemma2",
    "gemma3",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "llama",
    "llama_rope3_mqa",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
]
TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 12
# Out of order on purpose: a sequence's K/V must be found through its table, not by block id.
TABLE_A = [5, 2, 7, 0, 9]
TABLE_B = [6, 1, 11, 4, 3]


@functools.cache
def load(name: str, config_name: str | None = None) -> DecoderModel:
    """A fixture's model, under its config.json or under `config_{config_name}.json`."""
    folder = MODEL_FIXTURES / name
    config = json.loads((folder / f"config_{config_name}.json").read_text()) if config_name else hf.read_config(folder)
    return build_model(config, hf.read_weights(folder))


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(MODEL_FIXTURES / name / "reference.npz"))


def new_cache(model: DecoderModel) -> PagedKVCache:
    return PagedKVCache.for_model(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def step(model: DecoderModel, cache: PagedKVCache, chunks: list[tuple[np.ndarray, int, list[int]]]) -> list[mx.array]:
    """One forward over several sequences: each chunk is (new token ids, tokens cached before, table).

    Returns each sequence's logits for its new tokens, (len(new ids), vocab).
    """
    query_lens = [len(ids) for ids, _, _ in chunks]
    context_lens = [len(ids) + done for ids, done, _ in chunks]
    meta = AttentionMetadata.build([t for _, _, t in chunks], query_lens, context_lens, BLOCK_SIZE)
    input_ids = mx.array(np.concatenate([ids for ids, _, _ in chunks]).astype(np.int32))
    logits = model(input_ids, meta.positions, meta, cache)  # (num_tokens, vocab)
    starts = np.cumsum([0] + query_lens)
    return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def max_diff(ours: mx.array, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape
    return float(np.abs(np.array(ours) - theirs).max())


@pytest.mark.parametrize("name", NAMES)
def test_one_prefill_gives_transformers_logits_at_every_position(name):
    model, ref = load(name), reference(name)
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_prefill_of_half_then_one_token_per_step_gives_the_same_logits(name):
    model, ref = load(name), reference(name)
    ids, cache = ref["input_ids"], new_cache(model)
    half = len(ids) // 2
    rows = step(model, cache, [(ids[:half], 0, TABLE_A)])
    for i in range(half, len(ids)):
        rows += step(model, cache, [(ids[i : i + 1], i, TABLE_A)])
    assert max_diff(mx.concatenate(rows), ref["logits"]) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_two_sequences_in_one_call_each_get_their_own_logits(name):
    model, ref = load(name), reference(name)
    chunks = [(ref["input_ids"], 0, TABLE_A), (ref["input_ids_b"], 0, TABLE_B)]
    logits_a, logits_b = step(model, new_cache(model), chunks)
    assert max_diff(logits_a, ref["logits"]) < TOL
    assert max_diff(logits_b, ref["logits_b"]) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefills_of_two_sequences_share_steps(name):
    # Step 1 prefills a chunk of each; step 2 finishes A and takes B's next chunk; step 3 finishes B.
    model, ref = load(name), reference(name)
    a, b, cache = ref["input_ids"], ref["input_ids_b"], new_cache(model)
    a1, b1 = step(model, cache, [(a[:5], 0, TABLE_A), (b[:3], 0, TABLE_B)])
    a2, b2 = step(model, cache, [(a[5:], 5, TABLE_A), (b[3:7], 3, TABLE_B)])
    (b3,) = step(model, cache, [(b[7:], 7, TABLE_B)])
    assert max_diff(mx.concatenate([a1, a2]), ref["logits"]) < TOL
    assert max_diff(mx.concatenate([b1, b2, b3]), ref["logits_b"]) < TOL


def test_phi3_decoding_past_the_trained_length_uses_the_long_rope_factors_as_transformers():
    # transformers: a prefill within the original 12 positions, then one cached step per token;
    # steps at positions >= 12 rotate with the long factors.
    model, ref = load("phi3"), reference("phi3")
    ids, start, cache = ref["decode_ids"], int(ref["decode_from"]), new_cache(model)
    rows = step(model, cache, [(ids[:start], 0, TABLE_A)])
    for i in range(start, len(ids)):
        rows += step(model, cache, [(ids[i : i + 1], i, TABLE_A)])
    assert max_diff(mx.concatenate(rows), ref["decode_logits"]) < TOL


@pytest.mark.parametrize("name", ["gemma3", "llama_rope3_mqa"])
def test_older_config_keys_describe_the_same_model(name):
    # config_legacy.json spells RoPE as rope_theta + rope_scaling (and Gemma 3's
    # rope_local_base_freq + sliding_window_pattern); transformers reads it as the same model.
    model, ref = load(name, "legacy"), reference(name)
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) < TOL


def test_smollm3_config_giving_only_the_nope_interval_describes_the_same_model():
    # Hub configs may list no_rope_layers or only no_rope_layer_interval (every 4th layer, the default).
    config = {k: v for k, v in hf.read_config(MODEL_FIXTURES / "smollm3").items() if k != "no_rope_layers"}
    model, ref = build_model(config, hf.read_weights(MODEL_FIXTURES / "smollm3")), reference("smollm3")
    assert [layer.self_attn.rope is None for layer in model.layers] == [False, False, False, True]
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) < TOL


@pytest.mark.parametrize(
    "name, variant",
    [
        ("llama", "linear"),  # linear RoPE scaling
        ("qwen2", "window"),  # sliding window from max_window_layers on
        ("qwen3", "yarn"),
        ("qwen3", "yarn_mscale"),  # YaRN with mscale / mscale_all_dim and a custom beta_fast
        ("mixtral", "window"),  # sliding window in every layer
        ("qwen3_moe", "window"),  # use_sliding_window: every layer slides
        ("smollm3", "window"),  # use_sliding_window: the NoPE layers slide
        ("gpt_oss", "limit7"),  # the SwiGLU clamp of the released models
        ("gpt_oss_mxfp4", "limit7"),
    ],
)
def test_config_variant_on_the_same_weights_gives_transformers_logits(name, variant):
    model, ref = load(name, variant), reference(name)
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref[f"logits_{variant}"]) < TOL


def test_experts_stored_fused_load_as_the_same_model():
    folder = MODEL_FIXTURES / "qwen3_moe"
    weights = hf.read_weights(folder)
    prefix = "model.layers.0.mlp.experts"
    gate = mx.stack([weights.pop(f"{prefix}.{e}.gate_proj.weight") for e in range(4)])
    up = mx.stack([weights.pop(f"{prefix}.{e}.up_proj.weight") for e in range(4)])
    weights[f"{prefix}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)  # (experts, 2 * inter, hidden)
    weights[f"{prefix}.down_proj"] = mx.stack([weights.pop(f"{prefix}.{e}.down_proj.weight") for e in range(4)])
    model, ref = build_model(hf.read_config(folder), weights), reference("qwen3_moe")
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) < TOL


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_quantized_experts_run_kept_quantized_as_they_do_dequantized(name):
    # 8-bit expert triplets, as a quantized checkpoint stores them per expert: gather_qmm over the
    # stacked codes must compute what the float path computes from the dequantized weights.
    folder, ref = MODEL_FIXTURES / name, reference(name)
    weights = hf.read_weights(folder)
    for key in [k for k in weights if ".experts." in k]:
        codes, scales, biases = mx.quantize(weights[key], group_size=32, bits=8)
        stem = key.removesuffix(".weight")
        weights.update({key: codes, f"{stem}.scales": scales, f"{stem}.biases": biases})
    outputs = []
    for keep_quantized in (True, False):
        model = build_model(hf.read_config(folder), weights, group_size=32, keep_quantized=keep_quantized)
        (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
        outputs.append(logits)
    assert max_diff(outputs[0], np.array(outputs[1])) < TOL
    assert 0 < max_diff(outputs[0], ref["logits"]) < 0.1  # 8-bit rounding moves logits, a little


def test_quantized_triplets_need_no_group_size_and_a_wrong_one_is_named():
    # Bits and group size follow from the codes/scales shapes and the layer's input size: the model
    # computes what it computes from the same weights dequantized by hand.
    folder, ref = MODEL_FIXTURES / "llama", reference("llama")
    quantized, dequantized = hf.read_weights(folder), hf.read_weights(folder)
    for key in [k for k in quantized if k.endswith("_proj.weight")]:
        codes, scales, biases = mx.quantize(quantized[key], group_size=64, bits=4)
        stem = key.removesuffix(".weight")
        quantized.update({key: codes, f"{stem}.scales": scales, f"{stem}.biases": biases})
        dequantized[key] = mx.dequantize(codes, scales, biases, group_size=64, bits=4)
    outputs = []
    for weights in (quantized, dequantized):
        model = build_model(hf.read_config(folder), weights)
        outputs += step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(outputs[0], np.array(outputs[1])) < TOL
    message = "quantized tensor layers.0.self_attn.q_proj has groups of 64, not the 32 its metadata gives"
    with pytest.raises(ModelConfigError, match=f"^{re.escape(message)}$"):
        build_model(hf.read_config(folder), quantized, group_size=32)


def test_float32_model_kept_quantized_with_float16_scales_computes_as_dequantized():
    # A quantized embedding with float16 scales would otherwise hand float16 rows to every layer.
    folder, ref = MODEL_FIXTURES / "llama", reference("llama")
    weights = hf.read_weights(folder)
    for key in [k for k in weights if k.endswith(("_proj.weight", "embed_tokens.weight"))]:
        codes, scales, biases = mx.quantize(weights[key], group_size=32, bits=4)
        stem = key.removesuffix(".weight")
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)  # as GGUF stores them
        weights.update({key: codes, f"{stem}.scales": scales, f"{stem}.biases": biases})
    outputs = []
    for keep_quantized in (True, False):
        model = build_model(hf.read_config(folder), weights, keep_quantized=keep_quantized)
        outputs += step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(outputs[0], np.array(outputs[1])) < TOL


# Each fixture exercises what its architecture adds: without the feature, logits move well past TOL.
@pytest.mark.parametrize(
    "name, change",
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"layer_types": ["full_attention", "full_attention"]}),
        ("gemma3", {"layer_types": ["full_attention"] * 3}),
        ("gemma3", {"rope_parameters": None}),
        ("llama_rope3_mqa", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
        ("qwen3_moe", {"norm_topk_prob": True}),
        ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}),
        ("gpt_oss", {"swiglu_limit": 7.0}),
        ("gpt_oss", {"layer_types": ["full_attention", "full_attention"]}),
        ("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
        ("gpt_oss", {"num_experts_per_tok": 1}),
    ],
)
def test_fixture_depends_on_its_architecture_feature(name, change):
    folder, ref = MODEL_FIXTURES / name, reference(name)
    model = build_model({**hf.read_config(folder), **change}, hf.read_weights(folder))
    (logits,) = step(model, new_cache(model), [(ref["input_ids"], 0, TABLE_A)])
    assert max_diff(logits, ref["logits"]) > 100 * TOL
