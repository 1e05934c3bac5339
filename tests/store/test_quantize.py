"""Q2-Q8 affine quantization in MLX packing, and the profiles that choose a scheme per tensor."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from base_helpers import HEADER_FIELDS

from baselm.store.base_reader import read_base_file
from baselm.store.base_writer import write_base_file
from baselm.store.errors import ProfileError, QuantizationError
from baselm.store.quantize import (
    SCHEMES,
    Decision,
    QuantProfile,
    Rule,
    builtin_profile,
    load_profile,
    pack_codes,
    quantize,
    quantize_tensors,
    resolve_profile,
    unpack_codes,
    widen,
)

BITS = [2, 3, 4, 5, 6, 8]
UNIT_ROUNDOFF = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}
MX_SCALE = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def _mx(values: np.ndarray, dtype: str) -> mx.array:
    return mx.array(values).view(mx.bfloat16) if dtype == "bf16" else mx.array(values)


# ---------------------------------------------------------------------------------------------
# Packing


@pytest.mark.parametrize("bits", BITS)
def test_packing_is_mlx_packing(bits: int) -> None:
    """MLX's own codes unpack to the values MLX dequantizes them to, and pack back bit for bit."""
    w = mx.random.normal((8, 256), key=mx.random.key(bits))
    codes, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    values = mx.dequantize(codes, mx.ones_like(scales), mx.zeros_like(biases), group_size=64, bits=bits)
    unpacked = unpack_codes(np.array(codes), bits)  # (8, 256)
    assert np.array_equal(unpacked, np.array(values).astype(np.uint8))
    assert np.array_equal(pack_codes(unpacked, bits), np.array(codes))


@pytest.mark.parametrize("bits", BITS)
def test_packing_runs_across_its_chunks(bits: int) -> None:
    # 33 rows of 32,800 values: past the 2**20 values packed per pass, the first pass ending mid-row.
    values = np.random.default_rng(bits).integers(0, 1 << bits, size=(33, 32800), dtype=np.uint8)
    assert np.array_equal(unpack_codes(pack_codes(values, bits), bits), values)


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_covers_every_code(bits: int) -> None:
    values = (np.arange(4 * 96) % (1 << bits)).astype(np.uint8).reshape(4, 96)  # (out, in)
    codes = pack_codes(values, bits)
    assert codes.dtype == np.uint32 and codes.shape == (4, 96 * bits // 32)
    assert np.array_equal(unpack_codes(codes, bits), values)


# ---------------------------------------------------------------------------------------------
# The quantizer


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["f32", "f16", "bf16"])
def test_error_is_half_a_step_plus_rounding(bits: int, group_size: int, scale_dtype: str) -> None:
    rng = np.random.default_rng(bits + group_size)
    w = (rng.standard_normal((8, 256)) * 0.05).astype(np.float32)  # (out, in): weight-like magnitudes
    record = quantize(w, bits, group_size, scale_dtype)
    scales = _mx(record.scales, scale_dtype)
    dense = mx.dequantize(
        mx.array(record.codes), scales, _mx(record.biases, scale_dtype), group_size=group_size, bits=bits
    )
    error = np.abs(np.array(dense.astype(mx.float32)) - w).reshape(8, -1, group_size).max(axis=-1)
    largest = np.abs(w).reshape(8, -1, group_size).max(axis=-1)
    # Half a step, plus rounding of the stored bias, of scale * levels, and of the output.
    bound = np.array(scales.astype(mx.float32)) / 2 + 4 * UNIT_ROUNDOFF[scale_dtype] * largest
    assert (error <= bound).all()
    assert record.dtype == f"base_q{bits}" and record.scales.shape == (8, 256 // group_size)


def test_q4_codes_of_a_known_row() -> None:
    """One group 0..15 step 1: scale 1, bias 0, and codes equal to the values."""
    row = np.tile(np.arange(16, dtype=np.float32), 2)[None, :]  # (1, 32)
    record = quantize(row, 4, 32, "f32")
    assert record.scales.tolist() == [[1.0]] and record.biases.tolist() == [[0.0]]
    assert unpack_codes(record.codes, 4).tolist() == [list(range(16)) * 2]
    assert record.codes[0, 0] == 0x76543210


def test_constant_groups_are_exact() -> None:
    w = np.full((2, 64), -0.75, dtype=np.float32)
    record = quantize(w, 3, 32, "f16")
    dense = mx.dequantize(
        mx.array(record.codes), mx.array(record.scales), mx.array(record.biases), group_size=32, bits=3
    )
    assert np.array(dense).tolist() == w.tolist()


def test_non_finite_weights_are_refused() -> None:
    w = np.zeros((2, 64), dtype=np.float32)
    w[1, 3] = np.inf
    with pytest.raises(
        QuantizationError, match=r"^w: values are not finite or overflow f16 scales; use scale dtype f32$"
    ):
        quantize(w, 4, 64, "f16", name="w")


def test_f16_scale_overflow_is_refused_and_f32_works() -> None:
    w = np.array([[-1e6] * 32 + [1e6] * 32], dtype=np.float32)  # (1, 64): range 2e6 / 15 > 65504
    with pytest.raises(QuantizationError, match="overflow f16"):
        quantize(w, 4, 64, "f16")
    assert quantize(w, 4, 64, "f32").scales.dtype == np.float32


def test_bad_shapes_and_parameters_are_refused() -> None:
    with pytest.raises(QuantizationError, match=r"^x: shape \[4, 48\] is not 2-D with inputs divisible by 32$"):
        quantize(np.zeros((4, 48), np.float32), 4, 32, name="x")
    with pytest.raises(QuantizationError, match="cannot quantize to 7 bits"):
        quantize(np.zeros((4, 64), np.float32), 7, 32)


def test_bfloat16_input_is_quantized_from_its_exact_values() -> None:
    w = mx.random.normal((4, 128), key=mx.random.key(3)).astype(mx.bfloat16)
    record = quantize(w, 8, 128, "f32")
    dense = mx.dequantize(
        mx.array(record.codes), mx.array(record.scales), mx.array(record.biases), group_size=128, bits=8
    )
    step = record.scales.max()
    assert float(mx.abs(dense - w.astype(mx.float32)).max()) <= step / 2 * 1.0001


# ---------------------------------------------------------------------------------------------
# Schemes and profiles

LLAMA_TENSORS = {
    "model.embed_tokens.weight": (256, 128),
    "model.layers.0.input_layernorm.weight": (128,),
    "model.layers.0.self_attn.q_proj.weight": (128, 128),
    "model.layers.0.self_attn.v_proj.weight": (32, 128),
    "model.layers.0.self_attn.q_proj.bias": (128,),
    "model.layers.0.mlp.down_proj.weight": (128, 96),
    "model.layers.0.mlp.up_proj.weight": (96, 128),
    "model.layers.0.mlp.gate.weight": (8, 128),
    "model.layers.0.mlp.odd.weight": (8, 100),
    "model.norm.weight": (128,),
    "lm_head.weight": (256, 128),
}


def _dtypes(profile: QuantProfile) -> dict[str, tuple[str, int | None]]:
    out = {}
    for name, shape in LLAMA_TENSORS.items():
        decision = profile.decide(name, shape, "bf16")
        out[name] = (decision.dtype, decision.group_size)
    return out


def test_scheme_defaults() -> None:
    assert {n: (s.bits, s.group_size) for n, s in SCHEMES.items()} == {
        "q2": (2, 32),
        "q3": (3, 32),
        "q4": (4, 64),
        "q5": (5, 64),
        "q6": (6, 64),
        "q8": (8, 128),
        "f16": (None, None),
        "bf16": (None, None),
        "f32": (None, None),
    }


def test_default_q4_profile() -> None:
    assert _dtypes(builtin_profile("default", "q4")) == {
        "model.embed_tokens.weight": ("base_q8", 128),
        "model.layers.0.input_layernorm.weight": ("bf16", None),
        "model.layers.0.self_attn.q_proj.weight": ("base_q4", 64),
        "model.layers.0.self_attn.v_proj.weight": ("base_q4", 64),
        "model.layers.0.self_attn.q_proj.bias": ("bf16", None),
        "model.layers.0.mlp.down_proj.weight": ("base_q4", 32),  # 96 is not a multiple of 64: groups of 32
        "model.layers.0.mlp.up_proj.weight": ("base_q4", 64),
        "model.layers.0.mlp.gate.weight": ("bf16", None),  # an MoE router
        "model.layers.0.mlp.odd.weight": ("bf16", None),  # no group size divides 100
        "model.norm.weight": ("bf16", None),
        "lm_head.weight": ("base_q8", 128),
    }


@pytest.mark.parametrize(
    "router",
    [
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.block_sparse_moe.gate.weight",
        "model.layers.3.mlp.router.weight",
    ],
)
def test_default_profile_keeps_every_moe_router_float(router: str) -> None:
    # Qwen3-MoE, Mixtral and gpt-oss name their routers three ways; top-k picks are sensitive to rounding.
    assert builtin_profile("default", "q4").decide(router, (8, 128), "bf16").dtype == "bf16"


def test_mixed_q4_profile() -> None:
    dtypes = _dtypes(builtin_profile("mixed", "q4"))
    assert dtypes["model.layers.0.self_attn.v_proj.weight"] == ("base_q6", 64)
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == ("base_q4", 64)
    assert dtypes["model.embed_tokens.weight"] == ("base_q8", 128)
    assert builtin_profile("mixed", "q2").decide("a.down_proj.weight", (8, 64), "f32").dtype == "base_q4"


def test_float_scheme_profile_stores_everything_in_it() -> None:
    assert set(_dtypes(builtin_profile("default", "f16")).values()) == {("f16", None)}
    with pytest.raises(ProfileError, match="the mixed profile needs a quantized scheme"):
        builtin_profile("mixed", "f16")


def test_decisions_say_why_a_tensor_stayed_float() -> None:
    profile = builtin_profile("default", "q4")
    assert profile.decide("model.layers.0.mlp.odd.weight", (128, 100), "f32") == Decision(
        "model.layers.0.mlp.odd.weight",
        "f32",
        None,
        "rule '*' asks q4, but input dim 100 is not a multiple of group size 32; kept float",
    )
    assert (
        profile.decide("x.bias", (128,), "f16").reason
        == "rule '*' asks q4, but only 2-D .weight tensors are quantized; kept float"
    )


def test_first_matching_rule_wins_and_unmatched_names_stay() -> None:
    profile = QuantProfile("p", (Rule(r"layers\.0\.", "q8", is_regex=True), Rule("*.weight", "q3", 64)))
    first = profile.decide("model.layers.0.o.weight", (4, 128), "f32")
    assert (first.dtype, first.group_size) == ("base_q8", 128)
    second = profile.decide("model.layers.1.o.weight", (4, 64), "f32")
    assert (second.dtype, second.group_size) == ("base_q3", 64)
    assert profile.decide("scale", (4,), "f16") == Decision("scale", "f16", None, "no rule matches; kept as stored")


def test_default_group_size_steps_down_but_a_rule_group_size_is_kept() -> None:
    profile = QuantProfile("p", (Rule("a.*", "q8"), Rule("b.*", "q8", 128)))
    embed = profile.decide("a.weight", (49152, 576), "bf16")  # 576 = 9 * 64
    assert (embed.dtype, embed.group_size, embed.reason) == ("base_q8", 64, "rule 'a.*': q8, group 64")
    pinned = profile.decide("b.weight", (49152, 576), "bf16")
    assert (pinned.dtype, pinned.group_size) == ("bf16", None)
    assert pinned.reason == "rule 'b.*' asks q8, but input dim 576 is not a multiple of group size 128; kept float"


def test_unknown_profile_and_scheme() -> None:
    with pytest.raises(
        ProfileError, match=r"^unknown profile 'fast'; built-in profiles are default, mixed, or give a JSON file$"
    ):
        builtin_profile("fast", "q4")
    with pytest.raises(ProfileError, match=r"^unknown quantization scheme 'q7'"):
        builtin_profile("default", "q7")


def test_profile_file_round_trips(tmp_path: Path) -> None:
    profile = builtin_profile("mixed", "q3")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    assert resolve_profile(str(path), "q4") == profile
    assert resolve_profile("default", "q5") == builtin_profile("default", "q5")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{", "the profile is not valid JSON"),
        ('{"rules": [], "x": 1}', "a profile is an object with 'rules' (and optionally 'name'), nothing else"),
        ('{"name": 3, "rules": [{"match": "*", "scheme": "q4"}]}', "'name' must be a non-empty string"),
        ('{"rules": []}', "'rules' must be a non-empty list"),
        ('{"rules": [{"scheme": "q4"}]}', "rule 0 must be an object with exactly one of 'match' (glob) or 'regex'"),
        (
            '{"rules": [{"match": "*", "regex": "x", "scheme": "q4"}]}',
            "rule 0 must be an object with exactly one of 'match' (glob) or 'regex'",
        ),
        ('{"rules": [{"match": "*", "scheme": "q4", "bits": 4}]}', "rule 0 has unknown keys bits"),
        ('{"rules": [{"match": "", "scheme": "q4"}]}', "rule 0: the pattern must be a non-empty string"),
        ('{"rules": [{"regex": "(", "scheme": "q4"}]}', "rule 0: regex '(' does not compile"),
        (
            '{"rules": [{"match": "*", "scheme": "q4"}, {"match": "*", "scheme": "q7"}]}',
            "rule 1: scheme 'q7' is not one of q2, q3, q4, q5, q6, q8, f16, bf16, f32, float",
        ),
        (
            '{"rules": [{"match": "*", "scheme": "f16", "group_size": 32}]}',
            "rule 0: group_size applies only to quantized schemes, not f16",
        ),
        (
            '{"rules": [{"match": "*", "scheme": "q4", "group_size": 16}]}',
            "rule 0: group_size 16 must be 32, 64 or 128",
        ),
    ],
)
def test_bad_profile_files(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: {problem}")


def test_missing_profile_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read the profile"):
        resolve_profile(str(tmp_path / "none.json"), "q4")


# ---------------------------------------------------------------------------------------------
# End to end: profile -> writer -> reader


def test_quantized_model_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    source = {
        name: mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05).astype(mx.bfloat16)
        for name, shape in LLAMA_TENSORS.items()
    }
    profile = builtin_profile("mixed", "q4")
    decisions: list[Decision] = []
    stream = quantize_tensors(iter(source.items()), profile, decisions=decisions)
    path = write_base_file(tmp_path / "m.base", stream, **{**HEADER_FIELDS, "quant_profile": profile.to_json()})
    header, tensors = read_base_file(path, verify=True)
    assert [d.name for d in decisions] == list(LLAMA_TENSORS)
    assert {t["name"]: t["dtype"] for t in header["tensors"]} == {d.name: d.dtype for d in decisions}
    assert header["quant_profile"] == profile.to_json()
    for decision in decisions:
        loaded, original = tensors[decision.name], source[decision.name]
        if decision.is_quantized:
            step = float(loaded.scales.astype(mx.float32).max())
            assert float(mx.abs(loaded.dequantize().astype(mx.float32) - original.astype(mx.float32)).max()) <= step
        else:
            assert mx.array_equal(loaded, original).item() and loaded.dtype == mx.bfloat16


@pytest.mark.parametrize("source_bits, bits", [(4, 5), (4, 6), (4, 8), (5, 8), (4, 4)])
def test_widening_keeps_every_value_exactly(source_bits, bits):
    rng = np.random.default_rng(3)
    weights = rng.normal(0, 0.05, (8, 64)).astype(np.float32)
    source = quantize(weights, source_bits, 32, "f16", "w")
    wide = widen(source, bits, 32)
    assert wide is not None and wide.bits == bits

    def dequantized(record):
        scales = mx.array(record.scales.view(np.float16)).astype(mx.float32)
        biases = mx.array(record.biases.view(np.float16)).astype(mx.float32)
        return np.array(mx.dequantize(mx.array(record.codes), scales, biases, group_size=32, bits=record.bits))

    assert np.array_equal(dequantized(wide), dequantized(source))


def test_widening_refuses_what_it_cannot_keep_exactly():
    source = quantize(np.ones((4, 64), np.float32) * np.linspace(0, 1, 64, dtype=np.float32), 8, 32, "f16", "w")
    assert widen(source, 4, 32) is None  # fewer bits
    assert widen(source, 8, 64) is None  # other groups
