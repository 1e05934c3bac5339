"""The scheduler and the prefix cache with image requests: exact chunk boundaries and block hashes.

An image whose placeholders attend both ways (Gemma 3) is computed in one step: a chunk ends
before it, or runs past its end, never inside it. A causal image may be cut anywhere. Blocks
holding an image's placeholders are keyed by the image, so the same image hits and another misses.
"""

from __future__ import annotations

import numpy as np
import pytest

from baselm.kv.manager import KVCacheManager
from baselm.request import Request
from baselm.sampling.params import SamplingParams
from baselm.vision import PromptImage
from tests.engine.fake_model import make, plan, step

PROMPT = [5] * 6 + [9] * 10 + [6] * 8  # 24 tokens: an image's 10 placeholders at positions 6..15


def image(key: bytes = b"a", bidirectional: bool = True, start: int = 6, num_tokens: int = 10) -> PromptImage:
    return PromptImage(np.zeros(1), np.arange(start, start + num_tokens), key, bidirectional)


def image_request(request_id: str, *images: PromptImage, prompt: list[int] = PROMPT) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=2, seed=0), images=images)


def chunks(scheduler, model) -> list[tuple[int, int]]:
    """(num_computed_tokens before, tokens fed) of each step until the prompt is in."""
    fed = []
    while scheduler.has_unfinished:
        output, _ = step(scheduler, model)
        fed += [(c, n) for _, c, n, _ in plan(output)]
    return fed


def test_a_two_way_image_is_never_cut_a_chunk_stops_before_it_then_holds_it_whole():
    scheduler, model = make(block_size=4, budget=64, long_prefill_token_threshold=4)
    scheduler.add_request(image_request("r", image()))
    assert chunks(scheduler, model) == [(0, 4), (4, 2), (6, 10), (16, 4), (20, 4), (24, 1)]


def test_a_causal_image_is_cut_like_any_prompt():
    scheduler, model = make(block_size=4, budget=64, long_prefill_token_threshold=4)
    scheduler.add_request(image_request("r", image(bidirectional=False)))
    assert chunks(scheduler, model) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 1)]


def test_an_image_the_step_budget_cannot_hold_waits_for_a_step_that_can():
    scheduler, model = make(block_size=4, budget=12)
    scheduler.add_request(image_request("a", image(), prompt=PROMPT))
    scheduler.add_request(Request("b", [7] * 5, SamplingParams(max_tokens=1, seed=0)))
    first, _ = step(scheduler, model)
    assert plan(first) == [("a", 0, 6, False), ("b", 0, 5, True)]  # a stops before its image; b fills the rest
    second, _ = step(scheduler, model)
    assert plan(second) == [("a", 6, 12, False)]  # the image whole, and two tokens after it


def test_block_hashes_follow_the_image_in_them():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, again, b = image_request("a", image(b"a")), image_request("again", image(b"a")), image_request("b", image(b"b"))
    text = Request("text", PROMPT, SamplingParams(max_tokens=2))
    hashes = {r.request_id: kv.block_hashes(r, 6) for r in (a, again, b, text)}
    assert hashes["again"] == hashes["a"]
    assert hashes["b"][:1] == hashes["a"][:1] == hashes["text"][:1]  # block 0 (0..3) holds no placeholder
    assert all(x != y for x, y in zip(hashes["b"][1:], hashes["a"][1:]))  # from block 1 (4..7) on, all differ
    assert all(x != y for x, y in zip(hashes["text"][1:], hashes["a"][1:]))


def test_an_image_outside_the_prompt_is_refused():
    with pytest.raises(ValueError, match="has an image outside its prompt's positions"):
        image_request("r", image(start=20))
