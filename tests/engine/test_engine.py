"""LLMEngine behaviour: accounting, aborts, seeds, stops, logprobs, n > 1, the async client."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from baselm.async_engine import AsyncEngine
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from baselm.scheduler import RequestTooLongError

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [200] * 33, [1, 2]]


def all_free(engine: LLMEngine) -> bool:
    return engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_every_block_is_free_after_requests_finish(make_engine):
    engine = make_engine()
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7))
    assert [len(r.completions[0].token_ids) for r in results] == [7, 7, 7, 7]
    assert [r.completions[0].finish_reason for r in results] == ["length"] * 4
    assert [(c.num_prompt_tokens, c.num_output_tokens) for c in (r.completions[0] for r in results)] == [
        (len(p), 7) for p in PROMPTS
    ]
    assert all_free(engine)


def test_abort_frees_blocks_at_the_next_step(make_engine):
    engine = make_engine()
    keep = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))
    gone = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    used = engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks
    engine.abort(gone)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [(gone, "abort")]
    assert engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks < used
    while engine.has_unfinished:
        engine.step()
    assert all_free(engine)
    assert keep not in engine.output_processor


def test_aborting_before_the_copies_fork_reports_every_copy(make_engine):
    engine = make_engine()
    request_id = engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=1, max_tokens=5, n=3))
    engine.abort(request_id)
    outputs = engine.step()
    assert sorted((o.index, o.finish_reason) for o in outputs if o.finished) == [
        (0, "abort"),
        (1, "abort"),
        (2, "abort"),
    ]
    assert request_id not in engine.output_processor
    assert all_free(engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(make_engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = make_engine().generate([PROMPTS[1]], seeded)[0].completions[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=9), SamplingParams(temperature=0, max_tokens=5)]
    batch = make_engine().generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], seeded, others[1]])
    assert batch[1].completions[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12)
    assert make_engine().generate([PROMPTS[1]], other_seed)[0].completions[0].token_ids != alone


def test_stop_string_split_across_tokens_ends_the_text_before_it(make_engine):
    engine = make_engine()
    free_run = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16))[0].completions[0]
    text = free_run.text
    assert len(text) > 6
    # A stop string spanning the boundary of the 3rd and 4th tokens' text.
    pieces = [engine.tokenizer.decode(free_run.token_ids[:i]) for i in range(1, 6)]
    cut = len(pieces[2]) - 1
    stop = text[cut : cut + 3]
    assert stop and text.find(stop) == cut
    stopped = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0]
    assert stopped.completions[0].text == text[:cut]
    assert stopped.completions[0].finish_reason == "stop"
    assert stopped.completions[0].stop_reason == stop


def test_min_tokens_holds_back_a_stop_token(make_engine):
    engine = make_engine()
    free_run = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))[0].completions[0]
    first = free_run.token_ids[0]
    early = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))
    assert early[0].completions[0].token_ids == [first]
    held = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3)
    )[0].completions[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


def test_logprobs_are_the_log_softmax_of_the_logits(make_engine):
    engine = make_engine()
    captured = []

    def capture(output_ids, logits):
        captured.append(np.array(logits))
        return logits

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, logits_processors=[capture])
    completion = engine.generate([PROMPTS[1]], params)[0].completions[0]
    assert len(completion.logprobs) == 4
    for logits, entry in zip(captured, completion.logprobs):
        expected = logits - np.logaddexp.reduce(logits)
        assert entry.token_id == int(np.argmax(logits))
        assert abs(entry.logprob - expected[entry.token_id]) < 1e-5
        assert [t for t, _ in entry.top] == list(np.argsort(-expected)[:5])
        assert np.exp(expected).sum() == pytest.approx(1.0, abs=1e-5)


def test_n_copies_share_the_prompt_blocks(make_engine):
    engine = make_engine()
    prompt = list(range(1, 70))  # 69 tokens: 4 full blocks of 16, one partial
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=4))
    peak_used = 0
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
        peak_used = max(peak_used, engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks)
    finished = sorted((o.index, o.finish_reason) for o in outputs if o.finished)
    assert finished == [(i, "length") for i in range(4)]
    # Alone, four copies would hold 4 x 5 blocks; sharing the 4 full prompt blocks leaves 4 + 4 x 1.
    assert peak_used == 8
    assert all_free(engine)


def test_n_copies_with_a_seed_differ_from_each_other(make_engine):
    result = make_engine().generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=3))[0]
    assert [c.index for c in result.completions] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in result.completions}) > 1


def test_n_copies_each_run_their_own_processors(make_engine):
    histories = []

    def make():
        history = []
        histories.append(history)

        def record(output_ids, logits):
            history.append(list(output_ids))
            return logits

        return [record]

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, n=3, make_logits_processors=make)
    result = make_engine().generate([PROMPTS[1]], params)[0]
    assert len(histories) == 3
    for history, completion in zip(histories, result.completions):
        assert history == [completion.token_ids[:i] for i in range(5)]


def test_a_request_longer_than_the_model_is_refused(make_engine):
    engine = make_engine()
    with pytest.raises(RequestTooLongError, match="maximum context length is 512 tokens"):
        engine.add_request([7] * 500, SamplingParams(max_tokens=50))
    assert not engine.has_unfinished


def test_async_client_streams_and_aborts_on_early_exit(make_engine):
    engine = make_engine()
    client = AsyncEngine(engine).start()

    async def main():
        full = [o async for o in await client.submit(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))]
        stream = await client.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()
        with pytest.raises(RequestTooLongError):
            await client.submit([7] * 600, SamplingParams(max_tokens=5))
        deadline = time.monotonic() + 60  # the abort lands at the engine's next step; generous when loaded
        while not await client.run_on_engine(all_free) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return full

    try:
        full = asyncio.run(main())
    finally:
        client.stop()
    assert sum(len(o.token_ids) for o in full) == 6 and full[-1].finished
    assert all_free(engine)


@pytest.mark.parametrize("kv_bits, tol", [(8, 0.05), (4, 0.5)])
def test_quantized_kv_stays_close_to_float_kv(make_engine, kv_bits, tol):
    def record(into):
        def processor(output_ids, logits):
            into.append(np.array(logits))
            return logits

        return processor

    runs = {}
    for bits in (16, kv_bits):
        captured: list[np.ndarray] = []
        engine = make_engine(kv_bits=bits)
        params = SamplingParams(temperature=0, max_tokens=6, logits_processors=[record(captured)])
        engine.generate([PROMPTS[1]], params)
        assert all_free(engine)
        runs[bits] = np.stack(captured)
    assert runs[kv_bits].shape == runs[16].shape
    assert np.abs(runs[kv_bits][0] - runs[16][0]).max() < tol


def test_prompt_ids_outside_the_vocabulary_are_refused(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="outside the model's vocabulary of 256"):
        engine.add_request([1, 2, 256], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished


def test_pipelined_decode_gives_the_same_tokens_as_step_by_step(make_engine):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9] * 15, [4] * 16]
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.9, seed=5, max_tokens=23),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=1.0, seed=11, max_tokens=31, logprobs=2),
        SamplingParams(temperature=0, max_tokens=18, stop_token_ids=[17]),
    ]
    runs = {}
    for pipeline in (False, True):
        engine = make_engine(pipeline_decode=pipeline)
        results = engine.generate(prompts, params)
        assert all_free(engine)
        runs[pipeline] = [
            (c.token_ids, c.finish_reason, [lp.token_id for lp in c.logprobs]) for r in results for c in r.completions
        ]
    assert runs[True] == runs[False]


def test_pipelined_decode_launches_ahead_and_survives_an_abort(make_engine):
    engine = make_engine(pipeline_decode=True)
    keep = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30))
    gone = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None  # a decode step was launched before its inputs were read
    engine.abort(gone)
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {gone: "abort", keep: "length"}
    assert all_free(engine)
