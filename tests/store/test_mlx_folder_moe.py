"""MLX folders of mixtures of experts, as mlx-lm saves them (stacked `switch_mlp` experts): run
from the folder and pulled into the store, each gives the logits of the model that was saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from baselm.models import build_model
from baselm.store.base_reader import read_base_file
from baselm.store.import_local import import_local
from baselm.store.registry import Store
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES

PROMPT = [1, 5, 9, 42, 7, 3]


def mlx_lm_name(name: str, model_type: str) -> str:
    """baselm's parameter name as mlx-lm saves it: `model.` in front, the stacked experts under
    `switch_mlp` (Mixtral's MoE block under `block_sparse_moe`)."""
    if name.startswith("lm_head"):
        return name
    if ".mlp.experts." in name or (model_type == "mixtral" and ".mlp.gate." in name):
        name = name.replace(".mlp.experts.", ".mlp.switch_mlp.")
        if model_type == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
    return f"model.{name}"


def make_moe_mlx_folder(folder: Path, fixture: str) -> tuple[Path, nn.Module]:
    """The fixture quantized with `nn.quantize` (4 bits, groups of 32; the router left float, as
    mlx-lm leaves it), saved as mlx-lm saves it; and the quantized model itself."""
    config = json.loads((MODEL_FIXTURES / fixture / "config.json").read_text())
    weights = dict(mx.load(str(MODEL_FIXTURES / fixture / "model.safetensors")))
    model = build_model(config, weights, keep_quantized=True)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith(".gate"),
    )
    saved = {mlx_lm_name(k, config["model_type"]): v for k, v in nn.utils.tree_flatten(model.parameters())}
    assert any(".switch_mlp." in k for k in saved)
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), saved)
    quantization = {"group_size": 32, "bits": 4, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(config | {"quantization": quantization}))
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder, model


@pytest.mark.parametrize("fixture", ["qwen3_moe", "mixtral"])
def test_an_mlx_moe_folder_runs_and_pulls_with_the_saved_models_logits(fixture, tmp_path):
    folder, saved = make_moe_mlx_folder(tmp_path / f"Tiny-{fixture}-4bit", fixture)
    expected = prefill_logits(saved, PROMPT)
    run = load_model(str(folder), select_backend("cpu")).model
    np.testing.assert_allclose(prefill_logits(run, PROMPT), expected, atol=1e-4)
    stored = import_local(folder, supported={fixture}, store=Store(tmp_path / "home"))
    _, tensors = read_base_file(stored.path, verify=True)
    num_experts = saved.args.num_experts if fixture == "qwen3_moe" else saved.args.num_local_experts
    expert = "mlp.experts.{e}.gate_proj" if fixture == "qwen3_moe" else "block_sparse_moe.experts.{e}.w1"
    names = [f"model.layers.0.{expert.format(e=e)}.weight" for e in range(num_experts)]
    assert all(tensors[n].bits == 4 for n in names)  # one 2-D quantized matrix an expert
    pulled = load_model(str(stored.path), select_backend("cpu")).model
    np.testing.assert_allclose(prefill_logits(pulled, PROMPT), expected, atol=1e-4)
