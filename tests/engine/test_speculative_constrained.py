"""Speculation for requests with a grammar, logprobs or penalties: the same answer as without it.

A grammar's processor walks forward through the drafts as the verified rows ask for its mask,
and back to the tokens kept on the next call; proposals stop at the first token it refuses.
A request that asks for logprobs gets, for each emitted token, the logprobs of the row that
emitted it: the target's distribution there, as without speculation. Row j of a verification
sees drafts 0..j-1 as generated, so penalties count them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from baselm.config import SpeculativeConfig
from baselm.request import Request
from baselm.sampling.params import SamplingParams
from baselm.speculative.speculator import Speculator, can_speculate, num_allowed
from baselm.structured.grammar import GrammarProcessor, grammar_tokenizer, json_schema_grammar, regex_grammar
from tests.engine.test_speculative import all_free, engine_for, repeating_prompts
from tests.tiny_model import loaded_fixture

EOS = 2  # the grammar's end; the fixture model has no end-of-sequence ids of its own
WORDS = r"(one|two|three|four)( (one|two|three|four)){40}\."
LETTERS = r"[a-z]{2,6}( [a-z]{2,6}){30}\."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array"}}}
PROPOSERS = ["ngram", "ngram-fixed", "draft-self", "draft-other"]


def lltokenizer():
    loaded = loaded_fixture()
    return grammar_tokenizer(loaded.tokenizer, loaded.model.args.vocab_size, [EOS])


def grammar_params(grammar: str, **params) -> SamplingParams:
    lltok = lltokenizer()
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 40)
    return SamplingParams(
        stop_token_ids=[EOS], make_logits_processors=lambda: [GrammarProcessor(lltok, grammar, [EOS])], **params
    )


def chars(text: str) -> list[int]:
    """One fixture token per character (ids below the model's 256 rows)."""
    return [loaded_fixture().tokenizer.encode(c, add_special_tokens=False)[0] for c in text]


PROMPTS = [
    chars("one two three four one two one two three four one two three four xyz one two"),
    chars("name tags name tags {} {} one two"),
]


def texts_of(results) -> list[tuple[list[int], str]]:
    return [(r.completions[0].token_ids, r.completions[0].text) for r in results]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_grammar_answers_are_unchanged(proposer):
    grammars = [regex_grammar(WORDS), regex_grammar(LETTERS), json_schema_grammar(SCHEMA)]
    prompts = [p for p in PROMPTS for _ in grammars]
    params = [grammar_params(g) for _ in PROMPTS for g in grammars]
    plain = texts_of(engine_for(None).generate(prompts, params))
    engine = engine_for(proposer)
    assert texts_of(engine.generate(prompts, [grammar_params(g) for _ in PROMPTS for g in grammars])) == plain
    for (token_ids, _), grammar in zip(plain, grammars * len(PROMPTS)):
        assert GrammarProcessor(lltokenizer(), grammar, [EOS]).num_allowed([], token_ids) == len(token_ids)
    if not engine.config.speculative.adaptive:
        assert engine.spec_stats().num_draft_tokens > 0
    assert all_free(engine)


def test_grammar_requests_may_speculate_but_other_processors_may_not():
    assert can_speculate(_running(grammar_params(regex_grammar(WORDS))))
    assert not can_speculate(_running(SamplingParams(logits_processors=[lambda ids, logits: logits])))
    assert can_speculate(_running(SamplingParams(logprobs=3)))


def _running(params: SamplingParams, prompt: list[int] | None = None) -> Request:
    from baselm.request import RequestStatus

    request = Request("r", prompt or [1, 2, 3], params)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_ngram_proposals_are_cut_at_the_first_token_the_grammar_refuses():
    # After "ab ab" the n-gram proposes what followed "ab" before: " xy ".
    prompt = chars("ab xy ab")
    request = _running(grammar_params(regex_grammar(r"[ab ]+")), prompt)
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4), None, 64)
    assert num_allowed(request, chars(" ab")) == 3
    assert num_allowed(request, chars(" ax ")) == 2
    proposal = speculator._ngram(request, 4)
    assert proposal == chars(" xy ")
    assert speculator._allowed(request, proposal) == chars(" ")  # cut before x
    free = _running(SamplingParams(temperature=0), prompt)
    assert speculator._allowed(free, speculator._ngram(free, 4)) == chars(" xy ")


def test_grammar_processor_goes_back_to_the_tokens_kept():
    grammar = regex_grammar(WORDS)
    vocab = loaded_fixture().model.args.vocab_size
    walked = GrammarProcessor(lltokenizer(), grammar, [EOS])
    walked(chars("one one"), mx.zeros((vocab,)))  # drafts verified, then some of them rejected
    for kept in (chars("one t"), chars("o"), [], chars("one one two"), chars("one x"), chars("one")):
        fresh = GrammarProcessor(lltokenizer(), grammar, [EOS])
        expected = np.array(fresh(kept, mx.zeros((vocab,))))
        assert np.array_equal(np.array(walked(kept, mx.zeros((vocab,)))), expected)
        assert walked.consumed == fresh.consumed
    assert walked.num_allowed(chars("one x"), chars("x")) == 0  # past a refused token nothing is allowed
    assert walked.num_allowed(chars("one "), chars("two x")) == 4  # "two " then x is refused


def _logprob_tuples(completion) -> list[tuple]:
    return [(e.token_id, round(e.logprob, 4), [(t, round(lp, 4)) for t, lp in e.top]) for e in completion.logprobs]


@pytest.mark.parametrize("proposer", ["ngram-fixed", "draft-self", "draft-other"])
def test_greedy_logprobs_are_those_of_the_plain_engine(proposer):
    prompts = [p for _, p in repeating_prompts(count=4)]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)
    plain = [r.completions[0] for r in engine_for(None).generate(prompts, params)]
    engine = engine_for(proposer)
    spec = [r.completions[0] for r in engine.generate(prompts, params)]
    assert engine.spec_stats().num_draft_tokens > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert [e.token_id for e in b.logprobs] == b.token_ids
        assert [[t for t, _ in e.top] for e in b.logprobs] == [[t for t, _ in e.top] for e in a.logprobs]
        got = [e.logprob for e in b.logprobs] + [lp for e in b.logprobs for _, lp in e.top]
        want = [e.logprob for e in a.logprobs] + [lp for e in a.logprobs for _, lp in e.top]
        assert got == pytest.approx(want, abs=1e-4)  # k + 1 rows in one forward vs one row: float sums differ


def test_sampled_logprobs_are_the_targets_at_each_emitted_token():
    """With a draft model that is often rejected, emitted tokens come from accepted drafts, residual
    draws and bonus draws; each one's logprob is the target's, which the plain engine scores as a prompt."""
    prompt = repeating_prompts()[1][1]
    engine = engine_for("draft-other")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, logprobs=0) for seed in range(4)]
    outputs = [r.completions[0] for r in engine.generate([prompt] * 4, params)]
    stats = engine.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    scorer = engine_for(None)
    for out in outputs:
        assert [e.token_id for e in out.logprobs] == out.token_ids
        scored = scorer.generate([prompt + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
        target = [e.logprob for e in scored[0].completions[0].prompt_logprobs[len(prompt) - 1 :]]
        assert [e.logprob for e in out.logprobs] == pytest.approx(target, abs=1e-4)


def test_logprobs_end_with_the_tokens_when_a_run_is_cut():
    prompt = repeating_prompts()[1][1]
    plain = engine_for(None).generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].completions[0]
    stop_id = plain.token_ids[9]
    for params in (
        SamplingParams(temperature=0, max_tokens=5, logprobs=1),
        SamplingParams(temperature=0, max_tokens=24, logprobs=1, stop_token_ids=[stop_id]),
    ):
        out = engine_for("draft-self").generate([prompt], params)[0].completions[0]
        assert [e.token_id for e in out.logprobs] == out.token_ids
        assert out.token_ids == plain.token_ids[: len(out.token_ids)]


@pytest.mark.parametrize("proposer", ["ngram-fixed", "draft-self"])
def test_greedy_penalties_count_the_drafts_before_each_row(proposer):
    prompts = [p for _, p in repeating_prompts(count=4)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, frequency_penalty=-0.5),
    ]
    plain = texts_of(engine_for(None).generate(prompts, params))
    engine = engine_for(proposer)
    assert texts_of(engine.generate(prompts, params)) == plain
    assert engine.spec_stats().num_draft_tokens > 0
