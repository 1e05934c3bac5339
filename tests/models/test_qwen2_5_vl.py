"""Qwen2.5-VL with images against transformers, on the tiny random fixture
(tests/fixtures/models/qwen2_5_vl, tests/tools/make_qwen2_5_vl_fixture.py).

Our processor resizes within the fixture's pixel budget (one image grown by the min_pixels rule,
one shrunk by max_pixels) and lays the patches out as transformers' Qwen2VLImageProcessor does
(pixels equal), the prompt ids and the M-RoPE positions equal transformers', one forward gives its
logits within 1e-4 (float32) with one image and two, and the engine's greedy answers and the
logprobs of every generated token equal transformers' generate: tokens after the prompt sit at
their index plus the prompt's delta, also when prefill runs in chunks that cut images.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.models.qwen2_5_vl import window_order
from baselm.models.rope import MRoPE, RoPE
from baselm.sampling.params import SamplingParams
from baselm.vision import ImageError, image_processor
from tests.vision_fixture import QWEN2_5_VL, prompt_logits

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("tag", ["1", "2"])
def test_prompt_ids_pixels_and_grids_are_transformers(tag):
    ids, images = QWEN2_5_VL.prompt(tag)
    reference = QWEN2_5_VL.reference()
    assert ids == reference[f"input_ids_{tag}"].tolist()
    pixels = np.concatenate([i.pixels.reshape(-1, i.pixels.shape[-1]) for i in images])  # (patches, 3 * 2 * 4 * 4)
    np.testing.assert_array_equal(pixels, reference[f"pixel_values_{tag}"])
    grids = [[1, 2 * i.pixels.shape[0], 2 * i.pixels.shape[1]] for i in images]
    assert grids == reference[f"image_grid_thw_{tag}"].tolist()


def test_the_pixel_budget_grows_small_images_and_shrinks_large_ones():
    """min_pixels 2000, max_pixels 3000, multiples of 8: 30x40 -> 40x56, 70x50 -> 64x40, 20x100 -> 24x104."""
    loaded = QWEN2_5_VL.loaded()
    processor = image_processor(loaded.config, loaded.tokenizer)
    assert [processor.resized_size(h, w) for h, w in ((30, 40), (70, 50), (20, 100))] == [(40, 56), (64, 40), (24, 104)]
    with pytest.raises(ImageError, match="at most 200 times longer than it is wide"):
        processor.resized_size(1, 201)


@pytest.mark.parametrize("tag", ["1", "2"])
def test_mrope_positions_are_transformers(tag):
    ids, images = QWEN2_5_VL.prompt(tag)
    table, delta = QWEN2_5_VL.loaded().model.rope_positions(len(ids), images)
    np.testing.assert_array_equal(table, QWEN2_5_VL.reference()[f"position_ids_{tag}"])
    assert delta == table.max() + 1 - len(ids) < 0  # an image of n tokens moves later text on by its longer side


@pytest.mark.parametrize("tag", ["1", "2"])
def test_logits_at_every_position_are_transformers(tag):
    ids, images = QWEN2_5_VL.prompt(tag)
    reference = QWEN2_5_VL.reference()[f"logits_{tag}"]
    np.testing.assert_allclose(QWEN2_5_VL.logits(ids, images), reference, rtol=0, atol=1e-4)


def _generate(config: EngineConfig) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt's greedy ids and their logprobs, the two prompts and a text one batched together."""
    engine = LLMEngine(QWEN2_5_VL.loaded(), config)
    request_ids = {}
    for tag in ("1", "2"):
        ids, images = QWEN2_5_VL.prompt(tag, engine.image_processor)
        request_ids[tag] = engine.add_request(ids, GREEDY, images=images)
    engine.add_request(QWEN2_5_VL.loaded().tokenizer.encode_chat([{"role": "user", "content": "hello"}]), GREEDY)
    outputs: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            ids, logprobs = outputs.setdefault(out.request_id, ([], []))
            ids.extend(out.token_ids)
            logprobs.extend(e.logprob for e in out.logprobs)
    return {tag: outputs[r] for tag, r in request_ids.items()}


@pytest.mark.parametrize(
    "config",
    [EngineConfig(), EngineConfig(long_prefill_token_threshold=7, block_size=8)],
    ids=["one-pass", "chunks-of-7"],
)
def test_greedy_answers_and_their_logprobs_are_transformers(config):
    for tag, (ids, logprobs) in _generate(config).items():
        reference = QWEN2_5_VL.reference()
        assert ids == reference[f"greedy_{tag}"].tolist()
        logits = reference[f"decode_logits_{tag}"].astype(np.float64)  # (8, vocab): what each decode step saw
        top = logits.max(-1, keepdims=True)
        log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        np.testing.assert_allclose(logprobs, log_softmax[np.arange(8), ids], rtol=0, atol=1e-4)


def test_a_preempted_request_keeps_its_positions_and_answers_the_same():
    # 20 blocks of 8 tokens: the prompts take 7 and 13, and the first decode step needs two more
    engine = LLMEngine(QWEN2_5_VL.loaded(), EngineConfig(kv_memory=20 * 8 * 512, block_size=8, max_num_seqs=2))
    request_ids = {}
    for tag in ("1", "2"):
        ids, images = QWEN2_5_VL.prompt(tag, engine.image_processor)
        request_ids[tag] = engine.add_request(ids, GREEDY, images=images)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.scheduler.num_preemptions > 0
    for tag, request_id in request_ids.items():
        assert outputs[request_id] == QWEN2_5_VL.reference()[f"greedy_{tag}"].tolist()


def test_mrope_with_equal_rows_is_plain_rope():
    x = mx.array(np.random.default_rng(0).standard_normal((5, 2, 16)).astype(np.float32))
    positions = mx.array([0, 3, 7, 100, 4000], dtype=mx.int32)
    mrope, rope = MRoPE(16, 10000.0, [2, 3, 3]), RoPE(16, 10000.0)
    three_rows = mx.stack([positions] * 3)
    assert mx.allclose(mrope(x, three_rows), rope(x, positions), atol=1e-5).item()
    assert mx.array_equal(mrope(x, positions), rope(x, positions)).item()


def test_windows_cover_the_grid_row_by_row_with_smaller_ones_at_the_edges():
    order, bounds = window_order(3, 5, 2)  # a 3 x 5 grid of merged tokens, windows of 2 x 2
    assert bounds == [0, 4, 8, 10, 12, 14, 15]
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]


def test_the_nested_checkpoint_layout_loads_the_same_model(tmp_path):
    """`model.language_model.*` / `model.visual.*`, as some checkpoints name the tensors, is the same model."""
    folder = shutil.copytree(QWEN2_5_VL.folder, tmp_path / "nested")
    weights = mx.load(str(folder / "model.safetensors"))
    nested = {
        ("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(folder / "model.safetensors"), nested)
    loaded = load_model(folder, select_backend("cpu"))
    ids, images = QWEN2_5_VL.prompt("2", image_processor(loaded.config, loaded.tokenizer))
    np.testing.assert_allclose(prompt_logits(loaded.model, ids, images), QWEN2_5_VL.reference()["logits_2"], atol=1e-4)
