"""Every architecture base runs, as llama.cpp's converter writes it to GGUF, loads as the HF model.

Each model fixture (tests/fixtures/models) is written to an F32 GGUF the way `convert_hf_to_gguf.py`
writes it (tests/tiny_gguf.py: names, q/k permutation, Gemma's `1 + w` norms, stacked experts,
Phi-3's fused projections and LongRoPE tensors). Three checks per architecture:
- against transformers loading the same GGUF (`gguf_reference.npz`, tests/tools/make_gguf_fixtures.py);
- against the HF folder loaded by base with the config the GGUF implies (the tensor mapping alone);
- the implied config against the HF config, with llama.cpp's own rules where the file is silent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from baselm.backend import Backend
from baselm.loader import load_model, model_from_checkpoint
from baselm.store import gguf as gguf_store
from baselm.store.errors import ModelFileError, UnsupportedModelError
from tests.forward import prefill_logits
from tests.paths import MODEL_FIXTURES
from tests.tiny_gguf import (
    GGUF_ARCH,
    add_hparams,
    add_phi3_longrope_keys,
    add_word_vocabulary,
    converter_tensors,
    fixture_gguf,
    oracle,
    write_gguf,
)

TOL = 1e-4
CPU = Backend("cpu", mx.float32, keep_quantized=False)
ARCHS = ["llama", "llama_rope3_mqa", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_sparse"]
ARCHS += ["gemma2", "gemma3", "phi3", "smollm3"]  # gpt-oss: tests/store/test_gguf_gpt_oss.py
# Fixtures transformers reads from GGUF (not Mixtral: a llama GGUF with experts; not qwen3_moe: a dense layer,
# which qwen3_moe_sparse, experts in every layer, stands in for).
TRANSFORMERS_GGUF = [a for a in ARCHS if (MODEL_FIXTURES / a / "gguf_reference.npz").exists()]
# Fixtures whose HF config a GGUF says in full, so transformers' HF logits apply as they are.
SAME_CONFIG = ["llama", "llama_rope3_mqa", "mixtral", "qwen2", "qwen3", "qwen3_moe_sparse", "phi3", "smollm3"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: fixture_gguf(folder / f"{name}.gguf", MODEL_FIXTURES / name)[0] for name in ARCHS}


def gguf_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return prefill_logits(load_model(path, CPU).model, ids)


def test_every_architecture_base_runs_is_listed() -> None:
    from baselm.models import ARCHITECTURES
    from baselm.store.gguf_arch import ARCHS as GGUF_ARCHS
    from baselm.store.gguf_mmproj import PROJECTORS

    covered = {spec.model_type for spec in GGUF_ARCHS.values()} | {"mistral", "mixtral"}
    # vision-language models: a language model GGUF and an mmproj GGUF (SmolVLM's is Idefics3's model)
    covered |= set(PROJECTORS.values()) | {"smolvlm"}
    assert set(ARCHITECTURES) <= covered


@pytest.mark.parametrize("name", TRANSFORMERS_GGUF)
def test_a_gguf_gives_the_logits_transformers_gives_for_the_same_gguf(name: str, ggufs: dict[str, Path]) -> None:
    reference = np.load(MODEL_FIXTURES / name / "gguf_reference.npz")
    logits = gguf_logits(ggufs[name], reference["input_ids"])
    assert np.abs(logits - reference["logits"]).max() < TOL
    assert np.array_equal(logits.argmax(-1), reference["logits"].argmax(-1))


@pytest.mark.parametrize("name", ARCHS)
def test_a_gguf_gives_the_logits_of_its_hf_folder_under_the_config_the_gguf_implies(
    name: str, ggufs: dict[str, Path]
) -> None:
    folder = MODEL_FIXTURES / name
    ids = np.load(folder / "reference.npz")["input_ids"]
    config, weights, _ = gguf_store.load_checkpoint(ggufs[name])
    hf_weights = {k: mx.array(v) for k, v in load_file(str(folder / "model.safetensors")).items()}
    if "rope_freqs.weight" in weights:  # llama 3 scaling: a tensor in GGUF, config keys in HF
        hf_weights["rope_freqs.weight"] = weights["rope_freqs.weight"]
    expected = prefill_logits(model_from_checkpoint(dict(config), hf_weights, CPU), ids)
    logits = gguf_logits(ggufs[name], ids)
    assert np.abs(logits - expected).max() < TOL
    assert np.array_equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", SAME_CONFIG)
def test_a_gguf_of_a_fully_described_model_gives_transformers_hf_logits(name: str, ggufs: dict[str, Path]) -> None:
    reference = np.load(MODEL_FIXTURES / name / "reference.npz")
    ids = reference["input_ids"]
    if name == "phi3":  # LongRoPE: HF picks factors per call, base per token; equal before the trained length
        ids = ids[:12]
    logits = gguf_logits(ggufs[name], ids)
    assert np.abs(logits - reference["logits"][: len(ids)]).max() < TOL


def implied(name: str, ggufs: dict[str, Path]) -> tuple[dict, dict]:
    hf = json.loads((MODEL_FIXTURES / name / "config.json").read_text())
    return gguf_store.GGUFCheckpoint.open(ggufs[name]).config, hf


SHARED_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"]


@pytest.mark.parametrize("name", ARCHS)
def test_the_implied_config_has_the_hf_sizes(name: str, ggufs: dict[str, Path]) -> None:
    config, hf = implied(name, ggufs)
    keys = SHARED_KEYS + ["vocab_size", "intermediate_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"]
    assert {k: config[k] for k in keys} == {k: hf[k] for k in keys}
    renamed = {"mistral": "llama", "gemma3": "gemma3_text", "llama_rope3_mqa": "llama", "qwen3_moe_sparse": "qwen3_moe"}
    expected_type = renamed.get(name, name)
    assert config["model_type"] == expected_type


def test_moe_configs_carry_the_expert_routing(ggufs: dict[str, Path]) -> None:
    mixtral, hf = implied("mixtral", ggufs)
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"]) == (4, 2) == (hf["num_local_experts"], 2)
    qwen, hf = implied("qwen3_moe", ggufs)
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (4, 2, 32)
    assert qwen["mlp_only_layers"] == hf["mlp_only_layers"] == [1]  # a layer without a router is dense
    assert qwen["norm_topk_prob"] is True  # llama.cpp always renormalizes (the fixture's HF config does not)


def test_gemma_configs_follow_llama_cpp_where_the_file_is_silent(ggufs: dict[str, Path]) -> None:
    gemma2, hf2 = implied("gemma2", ggufs)
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (3.0, 5.0)
    assert gemma2["sliding_window"] == hf2["sliding_window"] and gemma2["layer_types"] == hf2["layer_types"]
    assert gemma2["query_pre_attn_scalar"] == hf2["head_dim"] != hf2["query_pre_attn_scalar"]  # 1/sqrt(head_dim)
    gemma3, _ = implied("gemma3", ggufs)
    assert gemma3["layer_types"] == ["sliding_attention"] * 3  # every 6th layer is global: none of 3
    assert gemma3["rope_scaling"] == {"rope_type": "linear", "factor": 4.0} and gemma3["rope_local_base_freq"] == 1e4
    assert gemma3["final_logit_softcapping"] is None


def test_phi3_longrope_comes_from_the_factor_tensors(ggufs: dict[str, Path]) -> None:
    phi3, hf = implied("phi3", ggufs)
    rope = hf["rope_parameters"]
    assert phi3["partial_rotary_factor"] == rope["partial_rotary_factor"]
    scaling = phi3["rope_scaling"]
    assert scaling["long_factor"] == rope["long_factor"]
    assert np.allclose(scaling["short_factor"], rope["short_factor"])
    assert scaling["original_max_position_embeddings"] == rope["original_max_position_embeddings"]


def test_pulling_a_gguf_gives_the_logits_of_running_it(ggufs: dict[str, Path], tmp_path: Path) -> None:
    from baselm.store.convert import convert

    ids = np.load(MODEL_FIXTURES / "gemma3" / "reference.npz")["input_ids"]
    for name in ("gemma3", "mixtral", "phi3"):
        convert(ggufs[name], tmp_path / f"{name}.base", None, None, "default")
        pulled = prefill_logits(load_model(tmp_path / f"{name}.base", CPU).model, ids)
        assert np.array_equal(pulled, gguf_logits(ggufs[name], ids)), name


# ---------------------------------------------------------------------------------------------
# Files that contradict themselves, or that base cannot place


def write_variant(
    tmp_path: Path,
    name: str,
    change: Callable[[dict, dict], str | None] | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """The fixture `name` as the converter writes it (F32, word vocabulary), with `change(config, HF weights)`
    applied first (it may return another architecture name) and `extra` metadata written after."""
    folder = MODEL_FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    arch = (change(config, weights) if change else None) or GGUF_ARCH[config["model_type"]]
    tensors = {k: (v, "F32") for k, v in converter_tensors(config, weights).items()}

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        add_word_vocabulary(writer, config)
        if extra is not None:
            extra(writer)

    return write_gguf(tmp_path / f"{name}.variant.gguf", tensors, metadata, arch=arch)


def test_head_counts_that_contradict_the_tensor_shapes_are_a_clear_error(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "llama", lambda config, _: config.update(num_attention_heads=2, head_dim=16))
    with pytest.raises(ModelFileError, match=r"contradicts its tensors: 2 heads of 16 gives 32, but blk\.0\.attn_q"):
        gguf_store.GGUFCheckpoint.open(path)


def test_a_block_count_below_the_layers_present_is_a_clear_error(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "llama", lambda config, _: config.update(num_hidden_layers=1))
    with pytest.raises(ModelFileError, match=r"block_count is 1, but blk\.1 exists"):
        gguf_store.GGUFCheckpoint.open(path)


def test_an_expert_count_that_contradicts_the_stacked_experts_is_a_clear_error(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "mixtral", lambda config, _: config.update(num_local_experts=8))
    with pytest.raises(ModelFileError, match=r"expert_count gives 8, but blk\.0\.ffn_\w+_exps\.weight has shape"):
        gguf_store.GGUFCheckpoint.open(path)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "llama", lambda config, tensors: "falcon")
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'falcon' is not supported \(supported: llama"):
        gguf_store.GGUFCheckpoint.open(path)


def test_a_tensor_with_no_place_is_named(tmp_path: Path) -> None:
    config = json.loads((MODEL_FIXTURES / "llama" / "config.json").read_text())
    tensors = {name: (values, "F32") for name, values in oracle(write_variant(tmp_path, "llama")).items()}
    tensors["blk.0.ssm_a.weight"] = (np.ones(4, np.float32), "F32")  # a Mamba tensor in a llama file
    path = write_gguf(tmp_path / "extra.gguf", tensors, lambda writer: add_hparams(writer, config))
    with pytest.raises(UnsupportedModelError, match=r"GGUF tensor 'blk\.0\.ssm_a\.weight' has no known place"):
        gguf_store.GGUFCheckpoint.open(path)  # before any weight is read


def _with_head(tmp_path: Path, name: str, rows: int, labels: list[str] | None) -> Path:
    """The `name` fixture as a GGUF with a classification head of `rows` rows (`cls.output.weight`)."""
    config = json.loads((MODEL_FIXTURES / name / "config.json").read_text())
    tensors = {key: (values, "F32") for key, values in oracle(write_variant(tmp_path, name)).items()}
    tensors["cls.output.weight"] = (np.ones((rows, config["hidden_size"]), np.float32), "F32")

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        if labels is not None:
            writer.add_array(f"{GGUF_ARCH[name]}.classifier.output_labels", labels)

    return write_gguf(tmp_path / "head.gguf", tensors, metadata, arch=GGUF_ARCH[name])


def test_a_qwen3_classification_head_becomes_a_sequence_classifiers_score(tmp_path: Path) -> None:
    checkpoint = gguf_store.GGUFCheckpoint.open(_with_head(tmp_path, "qwen3", 2, ["yes", "no"]))
    assert checkpoint.config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert checkpoint.config["id2label"] == {"0": "yes", "1": "no"}
    assert checkpoint.mx_weights()["score.weight"].shape == (2, 64)


def test_a_head_without_labels_has_one_per_row_and_labels_that_contradict_its_rows_are_refused(tmp_path: Path) -> None:
    unlabelled = gguf_store.GGUFCheckpoint.open(_with_head(tmp_path, "qwen3", 1, None))
    assert unlabelled.config["id2label"] == {"0": "LABEL_0"}
    with pytest.raises(ModelFileError, match=r"3 classifier labels, but cls\.output\.weight has 2 rows"):
        gguf_store.GGUFCheckpoint.open(_with_head(tmp_path, "qwen3", 2, ["a", "b", "c"]))


def test_a_classification_head_where_llama_cpp_reads_none_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"GGUF tensor 'cls\.output\.weight' has no known place in a llama"):
        gguf_store.GGUFCheckpoint.open(_with_head(tmp_path, "llama", 1, None))


def test_gguf_package_names_match_the_converter_names_used_here() -> None:
    """tests/tiny_gguf.py's names are the gguf package's own (its TENSOR_NAMES), for each architecture."""
    names = set(gguf.TENSOR_NAMES.values())
    stems = {"attn_qkv", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "post_ffw_norm"}
    stems |= {"post_attention_norm", "attn_q_norm", "attn_k_norm", "rope_factors_long", "rope_factors_short"}
    for stem in stems:
        assert any(n in (stem, f"blk.{{bid}}.{stem}") for n in names), stem


def test_end_of_turn_and_message_tokens_end_generation_like_end_of_text(tmp_path: Path) -> None:
    def extra(writer: gguf.GGUFWriter) -> None:  # eos is 2 in the word vocabulary
        writer.add_eot_token_id(7)
        writer.add_eom_token_id(2)

    path = write_variant(tmp_path, "llama", extra=extra)
    assert gguf_store.GGUFCheckpoint.open(path).config["eos_token_id"] == [2, 7]
    assert load_model(path, CPU).eos_token_ids[:2] == (2, 7)


@pytest.mark.parametrize(("name", "variant"), [("qwen3", "yarn"), ("llama", "linear")])
def test_rope_scaling_keys_give_transformers_logits_for_that_scaling(name: str, variant: str, tmp_path: Path) -> None:
    folder = MODEL_FIXTURES / name
    path, _ = fixture_gguf(tmp_path / f"{name}.gguf", folder, config_name=f"config_{variant}.json")
    reference = np.load(folder / "reference.npz")
    logits = gguf_logits(path, reference["input_ids"])
    assert np.abs(logits - reference[f"logits_{variant}"]).max() < TOL


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe", "gemma3", "phi3"])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_a_quantized_gguf_runs_as_its_values_dequantized_by_the_gguf_package(
    name: str, type_name: str, tmp_path: Path
) -> None:
    """Quantized matrices (stacked experts, fused and permuted rows included) keep their values exactly."""
    folder = MODEL_FIXTURES / name
    path, config = fixture_gguf(tmp_path / "q.gguf", folder, type_name)
    reader = gguf.GGUFReader(str(path))
    values = {t.name: (oracle(path)[t.name].reshape(tuple(reversed(t.shape.tolist()))), "F32") for t in reader.tensors}
    metadata = gguf_store.GGUFFile.open(path).metadata

    def same_metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        add_word_vocabulary(writer, config)
        if name == "phi3":
            add_phi3_longrope_keys(writer, config)

    dequantized = write_gguf(tmp_path / "f32.gguf", values, same_metadata, arch=metadata["general.architecture"])
    ids = np.load(folder / "reference.npz")["input_ids"]
    assert np.array_equal(gguf_logits(path, ids), gguf_logits(dequantized, ids))


def test_older_mixtral_ggufs_with_one_tensor_per_expert_load_alike(tmp_path: Path) -> None:
    folder = MODEL_FIXTURES / "mixtral"
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for name, value in converter_tensors(config, load_file(str(folder / "model.safetensors"))).items():
        if name.endswith("_exps.weight"):  # blk.{i}.ffn_gate_exps -> blk.{i}.ffn_gate.{e}, as llama.cpp once wrote
            for expert, matrix in enumerate(value):
                tensors[name.replace("_exps.weight", f".{expert}.weight")] = (matrix, "F32")
        else:
            tensors[name] = (value, "F32")

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        add_word_vocabulary(writer, config)

    path = write_gguf(tmp_path / "old.gguf", tensors, metadata)
    reference = np.load(folder / "reference.npz")
    assert np.abs(gguf_logits(path, reference["input_ids"]) - reference["logits"]).max() < TOL


def test_a_router_gated_other_than_by_softmax_is_refused(tmp_path: Path) -> None:
    path = write_variant(
        tmp_path, "qwen3_moe", extra=lambda writer: writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    )
    with pytest.raises(UnsupportedModelError, match=r"expert_gating_func 2 is not supported"):
        gguf_store.GGUFCheckpoint.open(path)


@pytest.mark.parametrize(("pattern", "expected"), [(2, ["s", "f", "s"]), ([True, False, False], ["s", "f", "f"])])
def test_a_gemma3_sliding_window_pattern_key_sets_the_layer_types(pattern, expected, tmp_path: Path) -> None:
    def extra(writer: gguf.GGUFWriter) -> None:
        if isinstance(pattern, list):
            writer.add_array("gemma3.attention.sliding_window_pattern", pattern)
        else:
            writer.add_uint32("gemma3.attention.sliding_window_pattern", pattern)

    checkpoint = gguf_store.GGUFCheckpoint.open(write_variant(tmp_path, "gemma3", extra=extra))
    names = {"s": "sliding_attention", "f": "full_attention"}
    assert checkpoint.config["layer_types"] == [names[k] for k in expected]


def test_the_gemma3_fixture_with_its_own_layer_pattern_gives_transformers_hf_logits(tmp_path: Path) -> None:
    """With the pattern in the file (2: layers 0 and 2 slide), the fixture's HF config is said in full."""
    path = write_variant(
        tmp_path, "gemma3", extra=lambda writer: writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    )
    reference = np.load(MODEL_FIXTURES / "gemma3" / "reference.npz")
    assert np.abs(gguf_logits(path, reference["input_ids"]) - reference["logits"]).max() < TOL


def test_llama_q_and_k_biases_are_unpermuted_like_their_weights(tmp_path: Path) -> None:
    hf: dict = {}

    def add_biases(config: dict, weights: dict) -> None:
        config["attention_bias"] = True
        rng = np.random.default_rng(0)
        for layer in range(config["num_hidden_layers"]):
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                rows = weights[f"model.layers.{layer}.self_attn.{proj}.weight"].shape[0]
                weights[f"model.layers.{layer}.self_attn.{proj}.bias"] = rng.standard_normal(rows).astype(np.float32)
        hf.update(config=config, weights={k: mx.array(v) for k, v in weights.items()})

    path = write_variant(tmp_path, "llama", add_biases)
    ids = np.load(MODEL_FIXTURES / "llama" / "reference.npz")["input_ids"]
    expected = prefill_logits(model_from_checkpoint(hf["config"], hf["weights"], CPU), ids)
    assert np.abs(gguf_logits(path, ids) - expected).max() < TOL


def test_a_feed_forward_length_that_contradicts_the_tensors_is_a_clear_error(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "llama", lambda config, _: config.update(intermediate_size=96))
    with pytest.raises(ModelFileError, match=r"feed_forward_length gives 96, but blk\.0\.ffn_\w+\.weight has shape"):
        gguf_store.GGUFCheckpoint.open(path)


def test_per_layer_head_counts_are_read_when_every_layer_agrees_and_refused_when_not(tmp_path: Path) -> None:
    def per_layer(counts: list[int]) -> Callable[[dict, dict], None]:
        return lambda config, _: config.update(head_count_kv_per_layer=counts)

    path = write_variant(tmp_path, "llama", per_layer([2, 2]))
    assert gguf_store.GGUFCheckpoint.open(path).config["num_key_value_heads"] == 2
    path = write_variant(tmp_path, "llama", per_layer([2, 4]))
    with pytest.raises(UnsupportedModelError, match=r"llama\.attention\.head_count_kv differs between layers"):
        gguf_store.GGUFCheckpoint.open(path)
