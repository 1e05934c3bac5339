"""SmolVLM / Idefics3 with images against transformers, on the tiny random fixture
(tests/fixtures/models/idefics3_vlm, tests/tools/make_idefics3_fixture.py).

Our processor cuts each image into the same tiles and global view as transformers' Idefics3
image processor (pixels equal), lays the prompt out as Idefics3Processor does (ids equal: rows of
`<row_R_col_C>` tiles, then `<global-img>`), one forward gives transformers' logits within 1e-4
(float32) with one image and with two, and the engine's greedy answers equal transformers'
generate, also when prefill is cut into chunks that start and end inside an image.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams
from baselm.vision import ImageError, decode_image, image_processor
from tests.vision_fixture import IDEFICS3, prompt_logits

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IMAGE_ID, FAKE_ID = 4, 3  # the fixture's <image> and <fake_token_around_image>


@pytest.mark.parametrize("tag", ["1", "2"])
def test_prompt_ids_and_pixels_are_transformers(tag):
    ids, images = IDEFICS3.prompt(tag)
    assert ids == IDEFICS3.reference()[f"input_ids_{tag}"].tolist()
    pixels = np.concatenate([i.pixels for i in images])  # (frames, 3, 32, 32): every image's frames in order
    np.testing.assert_array_equal(pixels, IDEFICS3.reference()[f"pixel_values_{tag}"])


def test_an_image_is_its_tiles_then_its_global_view():
    """Image A (40x30) becomes 2 x 2 tiles and a global view of 16 tokens each: 80 placeholders."""
    ids, (image,) = IDEFICS3.prompt("1")
    assert image.pixels.shape == (5, 3, 32, 32) and image.num_tokens == 80
    assert [ids[i] for i in image.positions] == [IMAGE_ID] * 80
    tokenizer = IDEFICS3.loaded().tokenizer
    tags = ["<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>", "<global-img>"]
    assert [ids[p - 1] for p in image.positions[::16]] == [tokenizer.token_to_id(t) for t in tags]
    assert ids[image.positions[-16] - 2] == FAKE_ID and ids[image.end] == FAKE_ID
    assert not image.bidirectional


@pytest.mark.parametrize("tag", ["1", "2"])
def test_logits_at_every_position_are_transformers(tag):
    ids, images = IDEFICS3.prompt(tag)
    np.testing.assert_allclose(IDEFICS3.logits(ids, images), IDEFICS3.reference()[f"logits_{tag}"], rtol=0, atol=1e-4)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    request_ids = []
    for tag in ("1", "2"):
        ids, images = IDEFICS3.prompt(tag, engine.image_processor)
        request_ids.append(engine.add_request(ids, GREEDY, images=images))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return [outputs[r] for r in request_ids]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(long_prefill_token_threshold=5, block_size=8),  # chunks start and end inside images
        EngineConfig(max_num_batched_tokens=24),
    ],
    ids=["one-pass", "chunks-of-5", "budget-24"],
)
def test_greedy_answers_are_transformers(config):
    first, second = _greedy(LLMEngine(IDEFICS3.loaded(), config))
    assert first == IDEFICS3.reference()["greedy_1"].tolist()
    assert second == IDEFICS3.reference()["greedy_2"].tolist()


def test_a_smolvlm_config_runs_the_same_model(tmp_path):
    """SmolVLM (model_type smolvlm) is Idefics3's architecture and layout under another name."""
    folder = shutil.copytree(IDEFICS3.folder, tmp_path / "smolvlm")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "smolvlm"}))
    loaded = load_model(folder, select_backend("cpu"))
    ids, images = IDEFICS3.prompt("2", image_processor(loaded.config, loaded.tokenizer))
    np.testing.assert_allclose(prompt_logits(loaded.model, ids, images), IDEFICS3.reference()["logits_2"], atol=1e-4)


def test_without_splitting_an_image_is_one_global_frame():
    loaded = IDEFICS3.loaded()
    preprocessor = {**loaded.config["preprocessor_config"], "do_image_splitting": False}
    processor = image_processor({**loaded.config, "preprocessor_config": preprocessor}, loaded.tokenizer)
    pixels, text = processor.process(decode_image(IDEFICS3.paths("1")[0].read_bytes()))
    assert pixels.shape == (1, 3, 32, 32)
    assert text == "<fake_token_around_image><global-img>" + "<image>" * 16 + "<fake_token_around_image>"


def test_a_preprocessor_whose_tiles_do_not_fit_the_tower_is_refused():
    loaded = IDEFICS3.loaded()
    config = {**loaded.config, "preprocessor_config": {"max_image_size": {"longest_edge": 48}}}
    with pytest.raises(ImageError, match="the model's tiles are 48 pixels but its vision tower takes 32"):
        image_processor(config, loaded.tokenizer)


def test_a_tokenizer_without_the_image_tokens_runs_text_and_says_why_images_are_refused():
    from dataclasses import replace

    from baselm.request import InvalidRequestError
    from tests.tiny_model import loaded_fixture

    engine = LLMEngine(replace(IDEFICS3.loaded(), name="mismatched", tokenizer=loaded_fixture("llama").tokenizer))
    assert engine.image_processor is None
    _, images = IDEFICS3.prompt("1")
    with pytest.raises(
        InvalidRequestError, match="model mismatched cannot take images: the model's vocabulary lacks <image>"
    ):
        engine.add_request([1] * 120, GREEDY, images=images)
