"""Speculative decoding over HTTP: the `speculative` extension field and the /metrics counters."""

from __future__ import annotations

import math

import pytest

from baselm.config import SpeculativeConfig
from tests.api.conftest import RunningServer

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def server():
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False)
    running = RunningServer(speculative=spec)
    yield running
    running.stop()


def complete(server: RunningServer, **extra) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    response = server.http().post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_opting_out_verifies_no_drafts_and_gives_the_same_text(server):
    before = server.metrics()
    plain = complete(server, speculative=False)
    after = server.metrics()
    assert after["base_spec_draft_tokens_total"] == before["base_spec_draft_tokens_total"]
    speculated = complete(server)
    assert speculated == plain
    final = server.metrics()
    assert final["base_spec_draft_tokens_total"] > after["base_spec_draft_tokens_total"]
    assert 0 <= final["base_spec_acceptance_rate"] <= 1
    assert final["base_spec_accepted_tokens_per_step"] >= 1
    assert final["base_spec_accepted_tokens_total"] <= final["base_spec_draft_tokens_total"]


def test_a_non_boolean_speculative_field_is_refused(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "speculative": "no"}
    response = server.http().post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "speculative" in response.text


# A long, repetitive answer, so that the n-gram proposer finds drafts in it.
WORDS = {"type": "string", "enum": ["one two", "three four"]}
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": WORDS, "minItems": 6, "maxItems": 6}},
    "required": ["words"],
    "additionalProperties": False,
}


def chat(server: RunningServer, speculative: bool):
    return server.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=80,
        temperature=0,
        logprobs=True,
        top_logprobs=5,  # under the grammar most alternatives are forbidden: only allowed ones are listed
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        extra_body={"speculative": speculative},
    )


def test_a_json_schema_request_with_logprobs_speculates_and_answers_the_same(server):
    plain = chat(server, speculative=False)
    before = server.metrics()["base_spec_draft_tokens_total"]
    speculated = chat(server, speculative=True)
    assert server.metrics()["base_spec_draft_tokens_total"] > before
    assert speculated.choices[0].message.content == plain.choices[0].message.content
    got, want = speculated.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [e.token for e in got] == [e.token for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for entry, other in zip(got, want):
        assert [t.token for t in entry.top_logprobs] == [t.token for t in other.top_logprobs]
        assert all(math.isfinite(t.logprob) for t in entry.top_logprobs)
    assert any(len(e.top_logprobs) < 5 for e in got)  # the grammar left fewer than 5 choices somewhere
