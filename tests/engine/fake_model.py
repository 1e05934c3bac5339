"""A fake model for driving the scheduler through many steps over a paged token store.

It stands in for the runner: it writes each fed token id into the slot its block table
names, reads every request's whole context back through the block table, and samples a
next token that is a fixed function of that context and the request's seed. So a wrong
block table, a bad prefix hit, an early eviction or a lost token changes the tokens, and
every test can compare against plain greedy generation.

It also stands in for the output processor's stop decision (`stops`), with the real stop
rules (sampling/stop.py) over ids alone: the fake model has no text.
"""

from __future__ import annotations

from baselm.kv.manager import KVCacheManager
from baselm.request import Request
from baselm.sampling.params import SamplingParams
from baselm.sampling.stop import StopChecker
from baselm.scheduler import Scheduler, SchedulerOutput

EOS = 7


def next_token(context: list[int], seed: int) -> int:
    """A deterministic 'model': the next id (1..40) as a hash of the whole context."""
    h = seed + 17
    for token_id in context:
        h = (h * 1_000_003 + token_id + 1) % 2_147_483_647
    return 1 + h % 40


def greedy(prompt: list[int], seed: int, max_tokens: int, eos: int | None = None) -> list[int]:
    """What the fake model generates for one request alone, with no cache at all."""
    context, out = list(prompt), []
    while len(out) < max_tokens:
        token_id = next_token(context, seed)
        context.append(token_id)
        out.append(token_id)
        if token_id == eos:
            break
    return out


class FakeModel:
    """Writes fed tokens into a paged store and samples from the context it reads back."""

    def __init__(self, kv: KVCacheManager, eos_token_ids: tuple[int, ...] = ()):
        self.kv = kv
        self.slots: list[int | None] = [None] * (kv.num_blocks * kv.block_size)
        self.eos_token_ids = eos_token_ids
        self._stops: dict[str, StopChecker] = {}  # request id -> its stop checker

    def step(self, output: SchedulerOutput) -> dict[str, list[int]]:
        for scheduled in output.requests:  # all writes first, as each layer writes before attending
            for i, token_id in enumerate(scheduled.token_ids):
                self.slots[self._slot(scheduled, scheduled.num_computed_tokens + i, writing=True)] = token_id
        sampled = {}
        for scheduled in output.requests:
            context = [self.slots[self._slot(scheduled, pos)] for pos in range(scheduled.context_len)]
            assert context == scheduled.request.all_token_ids[: scheduled.context_len]
            if scheduled.is_sampling:
                sampled[scheduled.request_id] = [next_token(context, scheduled.request.sampling_params.seed)]
        return sampled

    def stops(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, str]:
        """The finish reasons of the requests that stopped on `sampled` (eos, max_tokens), each
        request's ids in `sampled` cut after the one it stopped on, as the output processor does."""
        reasons = {}
        for scheduled in output.requests:
            request = scheduled.request
            if request.is_finished:
                continue
            stop = self._stops.setdefault(
                request.request_id, StopChecker(request.sampling_params, self.eos_token_ids, request.max_tokens)
            )
            token_ids = sampled.get(request.request_id, [])
            for i, token_id in enumerate(token_ids):
                reason = stop.update(token_id, "").finish_reason
                if reason is not None:
                    sampled[request.request_id], reasons[request.request_id] = token_ids[: i + 1], reason
                    break
        return reasons

    def _slot(self, scheduled, pos: int, writing: bool = False) -> int:
        size = self.kv.block_size
        block_id = scheduled.block_ids[pos // size]
        if writing:
            block = self.kv.pool.blocks[block_id]
            assert block.ref_cnt == 1 and block.block_hash is None, f"wrote into shared or cached block {block_id}"
        return block_id * size + pos % size


def make(
    num_blocks=16,
    block_size=4,
    max_num_seqs=8,
    budget=64,
    max_model_len=64,
    prefix_caching=True,
    eos_token_ids=(),
    **kwargs,
):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(
        kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, **kwargs
    )
    return scheduler, FakeModel(kv, tuple(eos_token_ids))


def request(request_id: str, prompt: list[int], max_tokens: int = 8, seed: int = 0) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=seed))


def step(scheduler: Scheduler, model: FakeModel):
    output = scheduler.schedule()
    sampled = model.step(output)
    return output, scheduler.update(output, sampled, model.stops(output, sampled))


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request_id, num_computed_tokens before, tokens fed, samples?) per scheduled request."""
    return [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.is_sampling) for s in output.requests]


def run_to_end(scheduler: Scheduler, model: FakeModel, max_steps: int = 500) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return tokens
        _, outputs = step(scheduler, model)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("requests did not finish")
