"""POST /v1/completions: prompt forms, n, echo, logprobs, streaming, usage."""

from __future__ import annotations

import pytest

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


def _prompt_scores(server, ids: list[int], num_top: int) -> list:
    """The engine's own prompt logprobs for `ids` (on its thread, nothing else in flight)."""
    from baselm.sampling.params import SamplingParams

    def score(engine, ids):
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=num_top)
        return engine.generate([ids], params)[0].completions[0].prompt_logprobs

    return server.client.call(score, ids).result(60)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server):
    prompt = "The quick brown fox jumps"
    ids = server.engine.tokenizer.encode(prompt)
    response = _complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    [choice] = response.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [server.engine.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scores = _prompt_scores(server, ids, 1)
    assert lp.token_logprobs[1:] == pytest.approx([s.logprob for s in scores], abs=1e-4)
    for top, s in zip(lp.top_logprobs[1:], scores):
        assert list(top.values()) == pytest.approx([s.top[0][1]], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)


def test_echo_with_logprobs_scores_the_prompt_then_the_answer_whole_and_streamed(server):
    prompt = ["Once upon a time", "The answer is"]
    whole = _complete(server, prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0, n=2)
    plain = _complete(server, prompt=prompt, max_tokens=4, logprobs=2, temperature=0, n=2)
    for choice, alone in zip(whole.choices, plain.choices):
        ids = server.engine.tokenizer.encode(prompt[choice.index // 2])
        assert choice.text == prompt[choice.index // 2] + alone.text
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 4
        # the same numbers up to float rounding: a step that also scores the prompt sums in another order
        assert lp.token_logprobs[len(ids) :] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
        assert lp.tokens[len(ids) :] == alone.logprobs.tokens
        scores = _prompt_scores(server, ids, 2)
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx([s.logprob for s in scores], abs=1e-4)
        assert lp.text_offset[len(ids) :] == [len(prompt[choice.index // 2]) + o for o in alone.logprobs.text_offset]
    streamed: dict[int, dict] = {}
    for chunk in _complete(server, prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            got = streamed.setdefault(c.index, {"text": "", "token_logprobs": [], "text_offset": []})
            got["text"] += c.text
            if c.logprobs:
                got["token_logprobs"] += c.logprobs.token_logprobs
                got["text_offset"] += c.logprobs.text_offset
    for choice in whole.choices:
        got = streamed[choice.index]
        assert got["text"] == choice.text
        assert got["text_offset"] == choice.logprobs.text_offset
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)


def test_max_tokens_0_needs_echo(server):
    response = server.http().post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_a_request_asks_for_at_most_256_choices_counted_before_any_prompt_is_read(server):
    http = server.http()

    def refused(body: dict, param: str) -> str:
        response = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        return response.json()["error"]["message"]

    message = refused({"prompt": [[1]] * 100_000, "n": 16}, "prompt")
    assert message == "100000 prompts with n 16 ask for 1600000 choices; a request asks for at most 256 (prompts × n)"
    assert refused({"prompt": ["x"] * 257}, "prompt").startswith("257 prompts with n 1 ask for 257 choices")
    assert refused({"prompt": ["x"] * 17, "n": 16}, "n").startswith("17 prompts with n 16 ask for 272 choices")
    served = _complete(server, prompt=[[1]] * 16, n=16, max_tokens=1, extra_body={"ignore_eos": True})
    assert [c.index for c in served.choices] == list(range(256))
