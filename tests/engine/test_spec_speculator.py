"""The speculator's bookkeeping between steps: what all requests' verifications teach about
n-gram proposals by the length of the suffix that matched, and requests caught up lazily."""

from __future__ import annotations

from types import SimpleNamespace

from baselm.config import SpeculativeConfig
from baselm.request import Request, RequestStatus
from baselm.sampling.params import SamplingParams
from baselm.speculative.policy import StepCost
from baselm.speculative.speculator import Speculator

SHORT = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8]  # ends with a 2-token suffix that occurred before
LONG = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]  # ends with a 5-token suffix that occurred before


def speculator() -> Speculator:
    spec = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4), None, 64)
    spec.cost = StepCost()
    for size in range(1, 9):
        spec.cost.observe(size, 1.0 + 0.15 * (size - 1))  # each verified row costs 15% of a step
    return spec


def running(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens, SamplingParams(temperature=0, max_tokens=64))
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens - 1
    return request


def step(spec: Speculator, requests: list[Request], accepted: int = 0) -> list[int]:
    """One step: proposals, then every verifying request accepts `accepted` of its drafts."""
    spec.propose(SimpleNamespace(running=requests))
    drafts = [len(r.draft_token_ids) for r in requests]
    scheduled = [
        SimpleNamespace(
            request=r, request_id=r.request_id, is_sampling=True, num_draft_tokens=n, num_scheduled_tokens=n + 1
        )
        for r, n in zip(requests, drafts)
    ]
    plan = SimpleNamespace(requests=scheduled, num_scheduled_tokens=sum(d + 1 for d in drafts))
    result = SimpleNamespace(num_accepted={r.request_id: min(accepted, n) for r, n in zip(requests, drafts) if n})
    spec.observe(plan, result, 0.0, SimpleNamespace(requests={r.request_id: r for r in requests}))
    return drafts


def test_short_matches_that_were_rejected_everywhere_are_not_tried_on_a_new_request():
    spec = speculator()
    assert step(spec, [running("first", SHORT)])[0] > 0  # the prior is worth a first draft
    for i in range(6):  # other requests' short matches are rejected too
        step(spec, [running(f"short{i}", SHORT)])
    assert step(spec, [running("fresh", SHORT)]) == [0]
    # Long matches have their own evidence, still the prior: a new request verifies them.
    assert step(spec, [running("long", LONG)])[0] > 0


def test_shared_evidence_fades_so_short_matches_are_tried_again_later():
    spec = speculator()
    for i in range(7):
        step(spec, [running(f"short{i}", SHORT)])
    assert step(spec, [running("fresh", SHORT)]) == [0]
    idle = running("idle", [1, 2, 3])  # steps that propose nothing: nothing matches
    for _ in range(1500):  # the shared evidence halves in ~700 steps
        assert step(spec, [idle]) == [0]
    assert step(spec, [running("later", SHORT)])[0] > 0


def test_accepted_short_matches_keep_being_verified():
    spec = speculator()
    for i in range(8):
        assert step(spec, [running(f"short{i}", SHORT)], accepted=4)[0] > 0


def test_a_draft_is_weighed_against_the_whole_batchs_yield():
    assert step(speculator(), [running("alone", SHORT)])[0] > 0
    # Beside seven decoding requests that propose nothing, 15% of a step for 0.6 tokens does not pay.
    others = [running(f"other{i}", [10 + i, 20 + i, 30 + i]) for i in range(7)]
    assert step(speculator(), [running("shared", SHORT), *others]) == [0] * 8
