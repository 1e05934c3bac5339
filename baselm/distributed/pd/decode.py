"""The decode side: a whole LLMEngine that also takes prompts another rank computed.

A handed-off request joins the decode engine in two moves around the KV transfer:

1. `admit`: the request is checked and given blocks for its prompt, the first ones as prefix
   hits on blocks this rank already holds (decode-side prefix hashes), so only the rest are
   shipped; it joins the running requests with its whole prompt computed. A constrained
   request gets processors of its own here, made from its constraint: their first call walks
   the new matcher over the first token. Its prompt logprobs came scored with the handoff.
2. `complete` (after the blocks arrived): the first token, sampled on the prefill side, goes
   through the engine's `update` like any sampled token: stop checks and max_tokens apply, it
   is appended, the full blocks are named in this rank's prefix cache, and its output (text,
   logprobs) is made here, so every token of an answer is reported by one engine.

From there the engine decodes the request as its own: continuous batching, speculative
decoding (`--speculative`), preemption by recompute when its pool runs short.
"""

from __future__ import annotations

from dataclasses import replace

from baselm.distributed.pd.prefill import Handoff
from baselm.engine import LLMEngine
from baselm.request import Request, RequestOutput, RequestStatus
from baselm.runner import RunnerOutput
from baselm.sampling.params import ConstraintFactory
from baselm.scheduler import ScheduledRequest, SchedulerOutput


def admit(engine: LLMEngine, handoff: Handoff, make_processors: ConstraintFactory | None = None) -> int | None:
    """Takes a handed-off request into the running batch; returns the index of its first block this
    rank lacks (the blocks from there on must be shipped), or None when it has no room now.
    `make_processors` makes a constrained request's processors from its constraint."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    if scheduler.num_running >= scheduler.max_num_seqs:
        return None
    num_prompt = len(handoff.prompt_token_ids)
    params = handoff.params.with_processors(make_processors)
    if params.prompt_logprobs is not None:  # scored on the prefill side; here its prefix may be hits
        params = replace(params, prompt_logprobs=None)
    request = Request(handoff.request_id, handoff.prompt_token_ids, params)
    scheduler.add_request(request)  # the room check and max_tokens, as for any request
    scheduler.waiting.pop()  # NOTE: add_request appended it; it runs at once or not at all
    computed_blocks, num_hit = kv.get_computed_blocks(request)
    if not kv.allocate_slots(request, num_prompt - num_hit, computed_blocks):
        del scheduler.requests[request.request_id]
        return None
    engine.output_processor.add([request])
    request.num_computed_tokens = num_prompt
    request.num_cached_tokens = handoff.num_cached_tokens
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return len(computed_blocks)


def block_ids(engine: LLMEngine, request_id: str) -> list[int]:
    return engine.kv_manager.block_table(engine.scheduler.requests[request_id])


def complete(engine: LLMEngine, handoff: Handoff) -> list[RequestOutput]:
    """Applies the first token of an admitted request whose blocks have arrived; returns its output."""
    request = engine.scheduler.requests.get(handoff.request_id)
    if request is None:  # aborted between admission and now
        return []
    scheduled = ScheduledRequest(
        request=request,
        token_ids=[],
        num_computed_tokens=request.num_computed_tokens,
        block_ids=block_ids(engine, handoff.request_id),
        is_sampling=True,
        is_new=True,
    )
    result = RunnerOutput(
        sampled_token_ids={handoff.request_id: [handoff.first_token_id]},
        logprobs={handoff.request_id: handoff.logprobs} if handoff.logprobs is not None else {},
        prompt_logprobs={handoff.request_id: handoff.prompt_logprobs},
    )
    return engine.update(SchedulerOutput([scheduled]), result)
