"""Speculative decoding over HTTP: the `speculative` extension field and the /metrics counters."""

from __future__ import annotations

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
