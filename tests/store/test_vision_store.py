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
from baselm.vision import decode_image, place_images
from tests.vision_fixture import FOLDER, IMAGE_A, messages_1, reference

VISION = ("vision_tower.", "multi_modal_projector.")


def _greedy_with_image(path: Path) -> list[int]:
    loaded = load_model(path, select_backend("cpu"))
    engine = LLMEngine(loaded)
    rendered = loaded.tokenizer.render_chat(messages_1({"type": "image"}))
    ids, images = place_images(loaded.tokenizer, rendered, [decode_image(IMAGE_A.read_bytes())], engine.image_processor)
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
