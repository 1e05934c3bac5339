"""Gemma 3 with images against transformers, on the tiny random fixture (tests/vision_fixture.py).

The prompt ids and pixels come out of our processor exactly as transformers' Gemma3Processor
makes them, one forward gives its logits within 1e-4 (float32) with one image and with two, and
the engine's greedy answers equal transformers' generate, also when prefill runs in chunks,
beside other requests, after preemption and with speculation on.
"""

from __future__ import annotations

import numpy as np
import pytest

from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from baselm.request import InvalidRequestError
from baselm.sampling.params import SamplingParams
from baselm.vision import PromptImage
from tests.vision_fixture import GEMMA3, loaded_vlm, reference

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(tag: str, engine: LLMEngine | None = None) -> tuple[list[int], list[PromptImage]]:
    """The reference's prompt `tag` ("1": image A; "2": images A and B) through our chat template and processor."""
    return GEMMA3.prompt(tag, engine.image_processor if engine is not None else None)


all_logits = GEMMA3.logits


@pytest.mark.parametrize("tag", ["1", "2"])
def test_prompt_ids_and_pixels_are_transformers(tag):
    ids, images = prompt(tag)
    assert ids == reference()[f"input_ids_{tag}"].tolist()
    np.testing.assert_array_equal(np.stack([i.pixels for i in images]), reference()[f"pixel_values_{tag}"])
    assert [(i.start, i.num_tokens) for i in images] == _image_runs(ids)


def _image_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of the fixture's image token (id 8)."""
    runs, at = [], 0
    while at < len(ids):
        if ids[at] == 8:
            end = at
            while end < len(ids) and ids[end] == 8:
                end += 1
            runs.append((at, end - at))
            at = end
        at += 1
    return runs


@pytest.mark.parametrize("tag", ["1", "2"])
def test_logits_at_every_position_are_transformers(tag):
    ids, images = prompt(tag)
    np.testing.assert_allclose(all_logits(ids, images), reference()[f"logits_{tag}"], rtol=0, atol=1e-4)


def test_image_tokens_attend_both_ways():
    """Causal attention over the image tokens gives other logits: the two-way mask is in effect."""
    ids, images = prompt("1")
    causal = [PromptImage(i.pixels, i.positions, i.key, bidirectional=False) for i in images]
    assert np.abs(all_logits(ids, causal) - reference()["logits_1"]).max() > 1e-2


def _greedy(engine: LLMEngine, tags: list[str]) -> tuple[list[list[int]], dict[str, list[int]]]:
    """The greedy ids of the prompts `tags`, and every request's ids (others queued before included)."""
    request_ids = []
    for tag in tags:
        ids, images = prompt(tag, engine)
        request_ids.append(engine.add_request(ids, GREEDY, images=images))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return [outputs[r] for r in request_ids], outputs


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(long_prefill_token_threshold=5, block_size=8),  # chunks of 5; an image extends its chunk
        EngineConfig(max_num_batched_tokens=20, block_size=8),  # a step holds one image and little else
        EngineConfig(speculative=SpeculativeConfig(method="ngram", ngram_min=1, adaptive=False)),
    ],
    ids=["one-pass", "chunks-of-5", "budget-20", "ngram-speculation"],
)
def test_greedy_answers_are_transformers_with_a_text_request_beside(config):
    engine = LLMEngine(loaded_vlm(), config)
    text_ids = loaded_vlm().tokenizer.encode_chat([{"role": "user", "content": "hello world"}])
    text_id = engine.add_request(text_ids, GREEDY)
    (first, second), outputs = _greedy(engine, ["1", "2"])
    assert first == reference()["greedy_1"].tolist()
    assert second == reference()["greedy_2"].tolist()
    assert len(outputs[text_id]) == 8  # the text request ran to its end beside them


def test_prompt_logprobs_through_chunks_are_one_pass_logits():
    """Every prompt position's score, prefilled in chunks of 5 (some starting inside an image, none
    ending inside one), is transformers' log-softmax at that position."""
    ids, images = prompt("2")
    scored = _prompt_logprobs(EngineConfig(long_prefill_token_threshold=5, block_size=8), ids, images)
    logits = reference()["logits_2"].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(scored, [log_softmax[i - 1, ids[i]] for i in range(1, len(ids))], rtol=0, atol=1e-4)


def test_a_preempted_image_request_recomputes_without_the_vision_tower_again():
    engine = LLMEngine(loaded_vlm(), EngineConfig(kv_memory=8 * 16 * 768, max_num_seqs=2))  # 8 blocks of 16
    first_ids, first_images = prompt("1", engine)
    second_ids, second_images = prompt("2", engine)
    engine.add_request(first_ids, GREEDY, images=first_images)
    engine.add_request(second_ids, GREEDY, images=second_images)
    engine.step()
    towers = [id(i.embeddings) for i in first_images + second_images]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.scheduler.num_preemptions > 0
    assert [id(i.embeddings) for i in first_images + second_images] == towers
    assert sorted(map(tuple, outputs.values())) == sorted(
        [tuple(reference()["greedy_1"][1:]), tuple(reference()["greedy_2"][1:])]
    )


def test_an_image_larger_than_a_step_is_refused_at_once():
    engine = LLMEngine(loaded_vlm(), EngineConfig(max_num_batched_tokens=8))
    ids, images = prompt("1", engine)
    with pytest.raises(
        InvalidRequestError, match=r"an image takes 16 tokens, computed in one step, but a step computes at most 8"
    ):
        engine.add_request(ids, GREEDY, images=images)


def test_a_text_model_refuses_images_by_name():
    from tests.tiny_model import loaded_fixture

    engine = LLMEngine(loaded_fixture("llama"))
    _, images = prompt("1")
    with pytest.raises(InvalidRequestError, match="model llama reads text only; it cannot take images"):
        engine.add_request([1] * 60, GREEDY, images=images)


def _prompt_logprobs(config: EngineConfig, ids: list[int], images: list[PromptImage]) -> list[float]:
    engine = LLMEngine(loaded_vlm(), config)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), images=images)
    scored = []
    while engine.has_unfinished:
        for out in engine.step():
            scored += [e.logprob for e in out.prompt_logprobs]
    return scored


def test_a_causal_image_cut_by_chunks_gives_the_one_pass_scores():
    """Images whose tokens attend causally may start or end a chunk mid-image: each chunk takes its rows
    of the tower's output, and the scores equal those of one pass."""
    ids, images = prompt("2")
    causal = [PromptImage(i.pixels, i.positions, i.key, bidirectional=False) for i in images]
    one_pass = _prompt_logprobs(EngineConfig(), ids, causal)
    copies = [PromptImage(i.pixels, i.positions, i.key, bidirectional=False) for i in images]
    chunked = _prompt_logprobs(EngineConfig(long_prefill_token_threshold=5, block_size=8), ids, copies)
    np.testing.assert_allclose(chunked, one_pass, rtol=0, atol=1e-5)
