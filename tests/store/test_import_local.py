"""`base pull <local path>`: HF folders, GGUF files, MLX folders and `.base` files go into the store
under `local/<name>`, load by that name, and (where nothing is rounded) give the source's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_mlx_folder import make_mlx_folder

from baselm.backend import Backend
from baselm.loader import load_model
from baselm.models import build_model
from baselm.sampling.defaults import SamplingDefaults, model_defaults
from baselm.store.base_reader import BaseFile
from baselm.store.convert import convert
from baselm.store.errors import BaseFileError, StoreError, UnsupportedModelError
from baselm.store.import_local import import_local
from baselm.store.mlx_folder import plain_config
from baselm.store.registry import Store
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, LLAMA_FIXTURE
from tests.tiny_gguf import llama_hf_oracle, tiny_llama_gguf

SUPPORTED = {"llama"}
CPU = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.array([1, 17, 42, 99, 7, 200, 3, 64, 128, 5])


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The store `load_model` resolves names in ($BASE_HOME)."""
    monkeypatch.setenv("BASE_HOME", str(tmp_path / "home"))
    return Store(tmp_path / "home")


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """The llama fixture with the tiny BPE tokenizer beside it, as an HF model folder."""
    folder = tmp_path / "src" / "Tiny-Llama"
    shutil.copytree(LLAMA_FIXTURE, folder, ignore=shutil.ignore_patterns("reference.npz", "config_linear.json"))
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def test_an_hf_folder_is_stored_under_local_and_its_f32_variant_gives_the_folders_logits(
    store: Store, hf_folder: Path
) -> None:
    model = import_local(hf_folder, quant="f32", supported=SUPPORTED, store=store)
    assert (model.ref, model.arch, model.quant, model.source["format"]) == (
        "local/Tiny-Llama:f32",
        "llama",
        "f32",
        "safetensors",
    )
    stored, source = load_model("local/Tiny-Llama", CPU), load_model(hf_folder, CPU)
    assert np.array_equal(prefill_logits(stored.model, IDS), prefill_logits(source.model, IDS))
    assert stored.tokenizer.encode("t5 t7") == source.tokenizer.encode("t5 t7")
    assert stored.eos_token_ids == source.eos_token_ids


def test_an_hf_folder_is_quantized_to_q4_unless_told_otherwise(store: Store, hf_folder: Path) -> None:
    model = import_local(hf_folder, supported=SUPPORTED, store=store)
    assert (model.ref, model.quant) == ("local/Tiny-Llama:q4", "q4")
    tensors = BaseFile.open(model.path).tensors
    assert {n: t.dtype for n, t in tensors.items() if "layers.0." in n or "layers" not in n} == {
        "lm_head.weight": "base_q8",
        "model.embed_tokens.weight": "base_q8",
        "model.norm.weight": "f32",
        "model.layers.0.input_layernorm.weight": "f32",
        "model.layers.0.post_attention_layernorm.weight": "f32",
        **{
            f"model.layers.0.{p}.weight": "base_q4"
            for p in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        },
    }
    assert prefill_logits(load_model(model.ref, CPU).model, IDS).shape == (len(IDS), 256)


def test_a_gguf_is_stored_as_its_own_quant_and_gives_the_logits_of_its_dequantized_weights(
    store: Store, tmp_path: Path
) -> None:
    path, config = tiny_llama_gguf(tmp_path / "Tiny-Llama.Q5_0.gguf", "Q5_0")
    model = import_local(path, supported=SUPPORTED, store=store)
    assert (model.ref, model.quant, model.source["format"]) == ("local/Tiny-Llama:q5_0", "q5", "gguf")
    stored, direct = load_model(model.ref, CPU), load_model(path, CPU)
    # Independent of our reader: the gguf package's dequantization, q/k rows put in HF order.
    hf = {name: mx.array(values) for name, values in llama_hf_oracle(path, config).items()}
    expected = prefill_logits(build_model(stored.config, hf), IDS)
    assert np.array_equal(prefill_logits(stored.model, IDS), expected)
    assert np.array_equal(prefill_logits(direct.model, IDS), expected)


def test_an_mlx_folder_is_stored_byte_for_byte_and_gives_the_folders_logits(store: Store, tmp_path: Path) -> None:
    folder = make_mlx_folder(tmp_path / "src" / "Tiny-Llama-4bit")
    model = import_local(folder, supported=SUPPORTED, store=store)
    assert model.ref == "local/Tiny-Llama-4bit:mlx-q4"
    config = json.loads((folder / "config.json").read_text())
    source = build_model(plain_config(config), dict(mx.load(str(folder / "model.safetensors"))))
    assert np.array_equal(prefill_logits(load_model(model.ref, CPU).model, IDS), prefill_logits(source, IDS))


def test_an_hf_folders_generation_config_is_stored_and_gives_the_models_sampling_defaults(
    store: Store, hf_folder: Path
) -> None:
    generation = {"eos_token_id": [2, 0], "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (hf_folder / "generation_config.json").write_text(json.dumps(generation))
    model = import_local(hf_folder, quant="q8", supported=SUPPORTED, store=store)
    loaded = load_model(model.ref, CPU)
    assert loaded.config["generation_config"] == generation  # kept whole, as HF wrote it
    assert model_defaults(loaded.config) == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)


def test_a_base_file_is_verified_and_copied_in_as_it_is(store: Store, hf_folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.base"
    convert(hf_folder, path, "q8", None, "mixed")
    model = import_local(path, supported=SUPPORTED, store=store)
    assert (model.ref, model.quant, model.source["format"]) == ("local/tiny:mixed-q8", "q8", "base")
    assert model.path.read_bytes() == path.read_bytes()
    assert np.array_equal(
        prefill_logits(load_model("local/tiny", CPU).model, IDS), prefill_logits(load_model(path, CPU).model, IDS)
    )


def test_a_damaged_base_file_is_refused_and_nothing_is_stored(store: Store, hf_folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.base"
    convert(hf_folder, path, "q4", None, "default")
    data = bytearray(path.read_bytes())
    data[BaseFile.open(path).blob_start + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BaseFileError, match="fails its checksum"):
        import_local(path, supported=SUPPORTED, store=store)
    assert store.list() == [] and not list(store.models_dir.rglob("*.base"))


def test_a_base_file_cannot_be_requantized_on_import(store: Store, hf_folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.base"
    convert(hf_folder, path, "q4", None, "default")
    with pytest.raises(
        StoreError,
        match=r"tiny\.base: a \.base file is stored as it is; --quant, --profile and --group-size do not apply",
    ):
        import_local(path, quant="q8", supported=SUPPORTED, store=store)


def test_name_overrides_the_default_and_a_bare_name_goes_under_local(store: Store, hf_folder: Path) -> None:
    assert (
        import_local(hf_folder, name="me/llama-mini", quant="f16", supported=SUPPORTED, store=store).ref
        == "me/llama-mini:f16"
    )
    assert import_local(hf_folder, name="mini", quant="f16", supported=SUPPORTED, store=store).ref == "local/mini:f16"
    with pytest.raises(StoreError, match="'a/b/c' is not a model name"):
        import_local(hf_folder, name="a/b/c", supported=SUPPORTED, store=store)


def test_importing_the_same_bytes_again_returns_the_stored_model_and_other_bytes_need_force(
    store: Store, hf_folder: Path
) -> None:
    first = import_local(hf_folder, quant="f16", supported=SUPPORTED, store=store)
    assert import_local(hf_folder, quant="f16", supported=SUPPORTED, store=store) == first
    config = json.loads((hf_folder / "config.json").read_text())
    (hf_folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(
        StoreError, match=r"local/Tiny-Llama:f16 is already stored from .*Tiny-Llama; pass --force to replace it"
    ):
        import_local(hf_folder, quant="f16", supported=SUPPORTED, store=store)
    replaced = import_local(hf_folder, quant="f16", supported=SUPPORTED, store=store, force=True)
    assert replaced.source["sha256"] != first.source["sha256"] and store.list() == [replaced]


def test_an_unsupported_architecture_is_refused_and_nothing_is_left_behind(store: Store, hf_folder: Path) -> None:
    config = json.loads((hf_folder / "config.json").read_text())
    (hf_folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="is a 'bert' model, which base does not run"):
        import_local(hf_folder, supported=SUPPORTED, store=store)
    assert store.list() == []
    assert [p.name for p in store.models_dir.rglob("*") if p.is_file()] == [".lock"]


def test_a_conversion_that_fails_midway_leaves_no_file_and_no_entry(store: Store, tmp_path: Path) -> None:
    folder = make_mlx_folder(tmp_path / "src" / "Broken-4bit")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.biases"]  # read after the writer has streamed earlier tensors
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.down_proj has no biases"):
        import_local(folder, supported=SUPPORTED, store=store)
    assert store.list() == []
    assert [p.name for p in store.models_dir.rglob("*") if p.is_file()] == [".lock"]


def test_a_path_that_is_no_model_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        StoreError, match=r"notes\.txt: not a model; give an HF or MLX model folder, a \.gguf file or a \.base file"
    ):
        import_local(tmp_path / "notes.txt", supported=SUPPORTED, store=store)
    with pytest.raises(StoreError, match="a model folder needs a config.json"):
        import_local(tmp_path, supported=SUPPORTED, store=store)
