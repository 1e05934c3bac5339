"""POST /v1/completions: prompt forms, n, echo, logprobs, streaming, usage."""

from __future__ import annotations

from tests.api.conftest import MODEL


def _complete(server, **kwargs):
    return server.openai().completions.create(model=MODEL, **kwargs)


def test_text_and_token_id_prompts_give_the_same_answer(server):
    ids = server.engine.tokenizer.encode("Once upon a time")
    by_text = _complete(server, prompt="Once upon a time", max_tokens=10, temperature=0)
    by_ids = _complete(server, prompt=ids, max_tokens=10, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 10


def test_default_max_tokens_is_16(server):
    response = _complete(server, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"


def test_several_prompts_times_n_are_ordered_prompt_major(server):
    prompts = ["Once upon a time", "The answer is"]
    single = [_complete(server, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts]
    batch = _complete(server, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [single[0], single[0], single[1], single[1]]
    ids = [server.engine.tokenizer.encode(p) for p in prompts]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert batch.usage.completion_tokens == 4 * 6
    as_ids = _complete(server, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in as_ids.choices] == single


def test_echo_prepends_the_prompt(server):
    plain = _complete(server, prompt="Echo me", max_tokens=5, temperature=0).choices[0].text
    echoed = _complete(server, prompt="Echo me", max_tokens=5, temperature=0, echo=True).choices[0].text
    assert echoed == "Echo me" + plain
    streamed = "".join(
        c.choices[0].text
        for c in _complete(server, prompt="Echo me", max_tokens=5, temperature=0, echo=True, stream=True)
        if c.choices
    )
    assert streamed == echoed


def test_logprobs_tokens_offsets_and_alternatives(server):
    response = _complete(server, prompt="Numbers:", max_tokens=5, temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert "".join(lp.tokens) == response.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for top, chosen, token in zip(lp.top_logprobs, lp.token_logprobs, lp.tokens):
        assert 1 <= len(top) <= 2  # two ids may decode to the same text
        assert max(top.values()) == chosen and top[token] == chosen


def test_stream_matches_whole_with_usage_chunk(server):
    whole = _complete(server, prompt=["a b c", "d e f"], max_tokens=7, temperature=0)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(
        _complete(
            server,
            prompt=["a b c", "d e f"],
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_seeded_sampling_repeats(server):
    a = _complete(server, prompt="seed", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    b = _complete(server, prompt="seed", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text
