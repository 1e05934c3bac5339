"""An MLX quantized folder (as mlx-lm saves one) is stored with its triplets byte for byte.

The folder is made here as mlx-lm makes one: the llama fixture built as an MLX model,
quantized with `mlx.nn.quantize` (per-layer bits and group sizes, one layer left float), its
parameters saved to safetensors, the choices written to config.json's `quantization` block.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file

from baselm.models import build_model
from baselm.store.base_reader import QuantizedArray, read_base_file
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.import_local import import_local
from baselm.store.registry import Store
from tests.paths import BPE_TOKENIZER, LLAMA_FIXTURE

SUPPORTED = {"llama"}
# Default 4-bit groups of 64; per-layer choices as mlx-lm's mixed recipes write them.
LAYERS = {
    "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},  # same codes/scales ratio as g64 q4
    "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 5},
    "model.layers.0.self_attn.v_proj": {"group_size": 64, "bits": 6},
    "model.layers.1.self_attn.q_proj": False,
}


def hf_path(path: str) -> str:
    """baselm's module paths (`layers.0.mlp`) as HF and mlx-lm name them (`model.layers.0.mlp`)."""
    return path if path.startswith("lm_head") else f"model.{path}"


def make_mlx_folder(folder: Path, strip_model_prefix: bool = False) -> Path:
    """The llama fixture quantized with `nn.quantize` as mlx-lm does, saved as an MLX folder.

    mlx-lm saves the HF names (`model.layers.0...`); `strip_model_prefix` saves names and config
    keys without `model.` instead, as a model class without that level would.
    """
    config = json.loads((LLAMA_FIXTURE / "config.json").read_text())
    model = build_model(config, dict(mx.load(str(LLAMA_FIXTURE / "model.safetensors"))), keep_quantized=True)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        own = LAYERS.get(hf_path(path), True)
        return own if isinstance(own, bool) else {**own, "mode": "affine"}

    nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # baselm's names: no `model.`
    layers = LAYERS
    if strip_model_prefix:
        layers = {k.removeprefix("model."): v for k, v in LAYERS.items()}
    else:
        weights = {hf_path(k): v for k, v in weights.items()}
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    quantization = {"group_size": 64, "bits": 4, "mode": "affine", **layers}
    config |= {"quantization": quantization, "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mlx_folder(tmp_path_factory.mktemp("mlx") / "Tiny-Llama-4bit")


def test_an_mlx_folder_is_stored_as_its_own_variant_with_every_tensor_byte_identical(
    mlx_folder: Path, tmp_path: Path
) -> None:
    model = import_local(mlx_folder, supported=SUPPORTED, store=Store(tmp_path))
    assert (model.ref, model.arch, model.quant, model.source["format"]) == (
        "local/Tiny-Llama-4bit:mlx-q4",
        "llama",
        "q4",
        "mlx",
    )
    header, tensors = read_base_file(model.path, verify=True)
    source = load_file(str(mlx_folder / "model.safetensors"))
    prefixes = {n.removesuffix(".scales") for n in source if n.endswith(".scales")}
    assert sorted(tensors) == sorted(n for n in source if not n.endswith((".scales", ".biases")))
    for name, value in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix in prefixes:
            assert isinstance(value, QuantizedArray)
            for part, array in (("weight", value.codes), ("scales", value.scales), ("biases", value.biases)):
                assert np.array(array).tobytes() == source[f"{prefix}.{part}"].tobytes(), f"{prefix}.{part}"
        else:
            assert np.array(value).tobytes() == source[name].tobytes(), name
    assert "quantization" not in header["config"] and "quantization_config" not in header["config"]


def test_per_layer_bits_and_group_sizes_come_from_the_config(mlx_folder: Path, tmp_path: Path) -> None:
    model = import_local(mlx_folder, supported=SUPPORTED, store=Store(tmp_path))
    _, tensors = read_base_file(model.path)
    layout = {
        n.removesuffix(".weight"): (t.bits, t.group_size) for n, t in tensors.items() if isinstance(t, QuantizedArray)
    }
    assert layout["model.layers.0.mlp.down_proj"] == (8, 32)
    assert layout["model.layers.1.mlp.down_proj"] == (5, 32)
    assert layout["model.layers.0.self_attn.v_proj"] == (6, 64)
    assert layout["model.layers.0.self_attn.q_proj"] == (4, 64)
    assert layout["model.embed_tokens"] == (4, 64)
    assert "model.layers.1.self_attn.q_proj" not in layout


def test_a_folder_saved_without_the_model_prefix_gets_hf_names(tmp_path: Path, mlx_folder: Path) -> None:
    folder = make_mlx_folder(tmp_path / "src" / "stripped", strip_model_prefix=True)
    store = Store(tmp_path / "store")
    stripped = read_base_file(import_local(folder, supported=SUPPORTED, store=store).path)[1]
    prefixed = read_base_file(import_local(mlx_folder, supported=SUPPORTED, store=store).path)[1]
    assert sorted(stripped) == sorted(prefixed)
    assert "lm_head.weight" in stripped and "model.norm.weight" in stripped


def test_a_triplet_that_disagrees_with_the_config_is_named(tmp_path: Path, mlx_folder: Path) -> None:
    folder = tmp_path / "wrong"
    shutil.copytree(mlx_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    # The file holds 8-bit groups of 32. (A config claiming 4-bit groups of 64 would fit the same
    # shapes, for 128 inputs: only the model's shapes tell those apart, when it is built.)
    config["quantization"]["model.layers.0.mlp.down_proj"] = {"group_size": 32, "bits": 5}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelFileError,
        match=(
            r"model\.layers\.0\.mlp\.down_proj's codes, scales and biases \(64, 16\), \(64, 2\), \(64, 2\) are not "
            r"5-bit groups of 32 as config\.json says"
        ),
    ):
        import_local(folder, supported=SUPPORTED, store=Store(tmp_path / "store"))
    assert Store(tmp_path / "store").list() == []


def test_non_affine_mlx_quantization_is_refused(tmp_path: Path, mlx_folder: Path) -> None:
    folder = tmp_path / "fp4"
    shutil.copytree(mlx_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["mode"] = "mxfp4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MLX 'mxfp4' quantized; base carries over only affine"):
        import_local(folder, supported=SUPPORTED, store=Store(tmp_path / "store"))


def test_requantizing_an_mlx_folder_is_asked_for_and_says_it_compounds_error(
    mlx_folder: Path, tmp_path: Path, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="baselm.store.quantize"):
        model = import_local(mlx_folder, quant="q8", supported=SUPPORTED, store=Store(tmp_path))
    assert caplog.messages == [
        "Tiny-Llama-4bit: requantizing its MLX q4 weights to q8 compounds the two rounding errors"
    ]
    _, tensors = read_base_file(model.path)
    assert model.variant == "q8" and tensors["model.layers.0.self_attn.q_proj.weight"].bits == 8
