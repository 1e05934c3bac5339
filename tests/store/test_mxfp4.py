"""An HF folder with MXFP4 experts (gpt-oss as released) converts to `.base` with the experts widened exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import Backend
from baselm.loader import load_model
from baselm.store.base_reader import BaseFile
from baselm.store.convert import convert
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.mxfp4 import widen_mxfp4
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES

CPU = Backend("cpu", mx.float32, keep_quantized=False)
FIXTURE = MODEL_FIXTURES / "gpt_oss_mxfp4"


@pytest.fixture
def mxfp4_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "gpt-oss-tiny"
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("reference.npz"))
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def test_converted_file_holds_bfloat16_experts_and_gives_transformers_logits(mxfp4_folder: Path, tmp_path: Path):
    target = tmp_path / "tiny.base"
    convert(mxfp4_folder, target, "f32", None, "default")
    header = BaseFile.open(target).header
    assert "quantization_config" not in header["config"]
    experts = {t["name"]: t for t in header["tensors"] if ".experts.gate_up_proj" in t["name"]}
    assert sorted(experts) == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.gate_up_proj_bias",
    ]
    assert experts["model.layers.0.mlp.experts.gate_up_proj"]["shape"] == [4, 64, 64]  # (experts, in, out)
    ref = np.load(FIXTURE / "reference.npz")
    logits = prefill_logits(load_model(target, CPU).model, ref["input_ids"])
    assert np.abs(logits - ref["logits"]).max() < 1e-4


def test_quantized_conversion_keeps_the_widened_experts_in_bfloat16(mxfp4_folder: Path, tmp_path: Path):
    # Only 2-D .weight tensors are quantized; the stacked experts stay as widened, exactly.
    target = tmp_path / "tiny-q8.base"
    convert(mxfp4_folder, target, "q8", None, "default")
    dtypes = {t["name"]: t["dtype"] for t in BaseFile.open(target).header["tensors"]}
    assert dtypes["model.layers.1.mlp.experts.down_proj"] == "bf16"
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == "base_q8"


def test_widening_is_exact():
    blocks = mx.array(np.arange(64, dtype=np.uint8).reshape(1, 2, 2, 16))  # (experts, out, in / 32, 16)
    scales = mx.array(np.array([[[127, 120], [130, 127]]], dtype=np.uint8))  # (experts, out, in / 32)
    dense = widen_mxfp4({"w_blocks": blocks, "w_scales": scales})["w"]  # (experts, in, out)
    assert dense.shape == (1, 64, 2) and dense.dtype == mx.bfloat16
    # Row 0 group 0, byte 1 = 0x01: value 2 is code 1 (0.5), value 3 is code 0 (0.0); scale 2 ** 0.
    assert dense[0, 2, 0].item() == 0.5 and dense[0, 3, 0].item() == 0.0
    # Row 1 group 0, byte 0 = 0x20 (32): low nibble code 0, high nibble code 2 (1.0); scale 2 ** 3.
    assert dense[0, 1, 1].item() == 8.0


def test_blocks_without_their_scales_are_named(mxfp4_folder: Path, tmp_path: Path):
    with pytest.raises(ModelFileError, match="w_blocks: not an MXFP4 tensor"):
        widen_mxfp4({"w_blocks": mx.zeros((2, 1, 16), dtype=mx.uint8)})


def test_other_quantization_methods_are_refused(mxfp4_folder: Path, tmp_path: Path):
    config = json.loads((mxfp4_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (mxfp4_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="its weights are gptq-quantized, which base cannot read"):
        convert(mxfp4_folder, tmp_path / "x.base", "q4", None, "default")
