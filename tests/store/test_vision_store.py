"""A vision-language model in a `.base` file: its vision tower and projector are kept, in float,
whatever the decoder is quantized to, and the file answers image requests as the folder does."""

from __future__ import annotations

from pathlib import Path

from baselm.backend import select_backend
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams
from baselm.store.base_reader import BaseFile
from baselm.store.convert import convert
from tests.vision_fixture import FOLDER, GEMMA3, IDEFICS3, QWEN2_5_VL, VisionFixture, reference

VISION = ("vision_tower.", "multi_modal_projector.")


def _greedy_with_image(path: Path, fixture: VisionFixture = GEMMA3) -> list[int]:
    """The greedy answer of the file at `path` to `fixture`'s first prompt (one image)."""
    engine = LLMEngine(load_model(path, select_backend("cpu")))
    ids, images = fixture.prompt("1", engine.image_processor)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=images)
    out: list[int] = []
    while engine.has_unfinished:
        for o in engine.step():
            out += o.token_ids
    return out


def test_a_q4_file_keeps_the_vision_tower_and_projector_in_float(tmp_path):
    path = tmp_path / "vlm.base"
    convert(FOLDER, path, "q4", None, "default")
    dtypes = {t["name"]: t["dtype"] for t in BaseFile.open(path).header["tensors"]}
    vision = {name: dtype for name, dtype in dtypes.items() if any(v in name for v in VISION)}
    assert len(vision) == 39 and set(vision.values()) == {"f32"}
    assert dtypes["language_model.model.layers.0.mlp.down_proj.weight"] == "base_q4"
    assert len(_greedy_with_image(path)) == 8  # the quantized decoder answers an image request


def test_an_f32_file_answers_an_image_as_transformers_does(tmp_path):
    path = tmp_path / "vlm.base"
    convert(FOLDER, path, "f32", None, "default")
    assert _greedy_with_image(path) == reference()["greedy_1"].tolist()


def test_an_idefics3_q4_file_keeps_its_tower_and_connector_float_and_the_preprocessor(tmp_path):
    path = tmp_path / "idefics3.base"
    convert(IDEFICS3.folder, path, "q4", None, "default")
    header = BaseFile.open(path).header
    dtypes = {t["name"]: t["dtype"] for t in header["tensors"]}
    vision = {n: d for n, d in dtypes.items() if n.startswith(("model.vision_model.", "model.connector."))}
    assert len(vision) == 38 and set(vision.values()) == {"f32"}
    assert dtypes["model.text_model.layers.0.mlp.down_proj.weight"] == "base_q4"
    assert header["config"]["preprocessor_config"]["max_image_size"] == {"longest_edge": 32}


def test_an_idefics3_f32_file_answers_as_transformers_does(tmp_path):
    path = tmp_path / "idefics3.base"
    convert(IDEFICS3.folder, path, "f32", None, "default")
    assert _greedy_with_image(path, IDEFICS3) == IDEFICS3.reference()["greedy_1"].tolist()


def test_a_qwen2_5_vl_q4_file_keeps_its_tower_float_and_answers_as_transformers_does_from_f32(tmp_path):
    convert(QWEN2_5_VL.folder, tmp_path / "q4.base", "q4", None, "default")
    dtypes = {t["name"]: t["dtype"] for t in BaseFile.open(tmp_path / "q4.base").header["tensors"]}
    vision = {n: d for n, d in dtypes.items() if n.startswith("visual.")}
    assert len(vision) == 1 + 4 * 12 + 5 and set(vision.values()) == {"f32"}  # patch embed, 4 blocks, merger
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "base_q4"
    assert len(_greedy_with_image(tmp_path / "q4.base", QWEN2_5_VL)) == 8
    convert(QWEN2_5_VL.folder, tmp_path / "f32.base", "f32", None, "default")
    assert _greedy_with_image(tmp_path / "f32.base", QWEN2_5_VL) == QWEN2_5_VL.reference()["greedy_1"].tolist()
