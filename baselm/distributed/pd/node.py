"""One rank of a prefill/decode group, and the step every rank takes together.

Ranks 0..P-1 are prefill ranks (a `PrefillWorker` each), ranks P..P+D-1 decode ranks (an
`LLMEngine` each); rank 0 also owns HTTP, tokenization and the request table (pd_engine.py).
The group moves in lockstep: every rank runs `Node.step` once per engine step, and each step
is the same five moves on every rank:

1. plan      rank 0 broadcasts the step's plan: new prompts (each given to a prefill rank),
             aborts, or the order to stop.
2. compute   each prefill rank runs one scheduled step over its prompts (chunked, prefix
             cache); each decode rank runs one engine step over its requests.
3. report    all ranks gather every rank's report: finished prompts waiting to be shipped
             (`Handoff`), the decode ranks' outputs, and each rank's load and block counts.
4. admit     every rank computes the same assignment of finished prompts to decode ranks
             (the least loaded first); each decode rank admits its own, taking prefix hits on
             blocks it already holds, and all ranks gather how many leading blocks each
             decode rank already has (or that it has no room: the prompt stays parked).
5. ship      for each admitted prompt, in the same order on every rank, the prefill rank
             sends the blocks the decode rank lacks (pd_wire.transfer, relayed along the
             ring) and frees its own; the decode rank writes them into its pool and applies
             the first token, whose outputs reach rank 0 in one more gather.

What sizes and routes a transfer comes from other ranks (a handoff's rank and block count, an
admission's first block), so every rank checks the gathered reports and admissions before it
acts on them (`check_reports`, `check_admissions`): each rank sees the same ones, so all of
them refuse a bad one together, with a MessageError.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from baselm.config import ConfigError
from baselm.distributed.comm import MessageError
from baselm.distributed.pd import blocks as pd_blocks
from baselm.distributed.pd import codec as pd_codec
from baselm.distributed.pd import decode as pd_decode
from baselm.distributed.pd import wire as pd_wire
from baselm.distributed.pd.prefill import Handoff, PrefillWorker
from baselm.engine import LLMEngine
from baselm.request import RequestOutput
from baselm.sampling.params import Constraint, ConstraintFactory, SamplingParams, TokenLogprobs

log = logging.getLogger("baselm.distributed")


@dataclass(slots=True, frozen=True)
class Layout:
    """How many prefill and decode ranks a group has: prefill ranks first, rank 0 among them."""

    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ConfigError(f"--pd {self}: give at least one prefill and one decode process, e.g. --pd 1:1")

    def __str__(self) -> str:
        return f"{self.num_prefill}:{self.num_decode}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'P:D' -> Layout(P, D)."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"--pd {text!r}: write prefill:decode process counts, e.g. --pd 1:1 or --pd 2:1")
        return cls(int(parts[0]), int(parts[1]))

    @property
    def size(self) -> int:
        return self.num_prefill + self.num_decode

    def role(self, rank: int) -> str:
        return "prefill" if rank < self.num_prefill else "decode"

    @property
    def decode_ranks(self) -> range:
        return range(self.num_prefill, self.size)


@dataclass(slots=True)
class Plan:
    """Rank 0's orders for one step."""

    add: list[tuple[int, str, list[int], SamplingParams]] = field(default_factory=list)  # (prefill rank, id, ...)
    abort: list[str] = field(default_factory=list)
    save: bool = False  # prefill ranks save their prefix cache files (as they also do on stop)
    stop: bool = False


@dataclass(slots=True)
class RankStats:
    """One rank's queues and blocks, and what its transfers moved."""

    rank: int
    role: str
    num_running: int = 0  # decode: requests decoding; prefill: prompts being computed
    num_waiting: int = 0
    num_parked: int = 0  # prefill: finished prompts waiting for a decode rank
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_bytes_sent: int = 0  # prefill: KV bytes shipped
    kv_blocks_sent: int = 0
    kv_blocks_hit: int = 0  # decode: prompt blocks it already held, not shipped
    prompt_tokens_handed: int = 0  # prefill: prompt tokens of the requests it handed off
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class Report:
    rank: int
    handoffs: list[Handoff]
    outputs: list[RequestOutput]
    stats: RankStats


pd_codec.register(Plan, Report, RankStats, Handoff, RequestOutput, SamplingParams, TokenLogprobs, Constraint)


def check_reports(reports: list[Report], layout: Layout, block_size: int, vocab_size: int) -> None:
    """Raises MessageError unless report r is rank r's and each of its handoffs is its own (a
    prefill rank's), holding the blocks its prompt fills and token ids of the vocabulary."""
    if [report.rank for report in reports] != list(range(layout.size)):
        raise MessageError(f"the reports came from ranks {[r.rank for r in reports]}, not 0..{layout.size - 1}")
    for report in reports:
        for handoff in report.handoffs:
            ids = handoff.prompt_token_ids
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
                raise MessageError(
                    f"rank {report.rank} handed off request {handoff.request_id!r} with a prompt "
                    f"that is not token ids of a vocabulary of {vocab_size}"
                )
            own = handoff.src == report.rank and layout.role(report.rank) == "prefill"
            if not own or handoff.num_blocks != -(-len(ids) // block_size):
                raise MessageError(
                    f"rank {report.rank} handed off request {handoff.request_id!r} as rank {handoff.src!r}'s, with "
                    f"{handoff.num_blocks!r} blocks for {len(ids)} prompt tokens of blocks of {block_size}"
                )


def check_admissions(parts: list[Any], moves: list[tuple[Handoff, int]]) -> dict[str, int]:
    """Each admitted request's first missing block, from every rank's admissions (`parts`, by rank);
    a MessageError unless a rank admitted only requests assigned to it, from a block they have."""
    assigned = {handoff.request_id: (dst, handoff.num_blocks) for handoff, dst in moves}
    answers: dict[str, int] = {}
    for rank, part in enumerate(parts):
        if not isinstance(part, dict):
            raise MessageError(f"rank {rank} sent a {type(part).__name__} where its admissions go")
        for request_id, first in part.items():
            dst, num_blocks = assigned.get(request_id, (None, 0))
            if dst != rank or type(first) is not int or not 0 <= first <= num_blocks:
                raise MessageError(
                    f"rank {rank} admitted request {request_id!r} from block {first!r}: it was handed "
                    f"to rank {dst}, with {num_blocks} blocks"
                )
            answers[request_id] = first
    return answers


def assign(reports: list[Report], layout: Layout) -> list[tuple[Handoff, int]]:
    """Each finished prompt's decode rank: the one with the fewest requests, counting those
    assigned this step; ties to the lowest rank. The same on every rank (it sees the same reports)."""
    load = {r.rank: r.stats.num_running + r.stats.num_waiting for r in reports if r.rank in layout.decode_ranks}
    moves = []
    for report in reports:
        for handoff in report.handoffs:
            dst = min(load, key=lambda rank: (load[rank], rank))
            load[dst] += 1
            moves.append((handoff, dst))
    return moves


class Node:
    """This process's rank of the group: its worker (prefill) or engine (decode), and the step.

    `constraints` makes a constrained request's processors from its constraint, on the rank that
    samples it (None: this group refuses constrained requests)."""

    def __init__(
        self,
        group,
        layout: Layout,
        worker: PrefillWorker | None = None,
        engine: LLMEngine | None = None,
        constraints: ConstraintFactory | None = None,
    ):
        self.group = group
        self.constraints = constraints
        self.rank = group.rank()
        self.layout = layout
        self.worker = worker
        self.engine = engine
        self.cache = worker.cache if worker is not None else engine.cache
        self.block_nbytes = pd_blocks.block_nbytes(self.cache)
        self.vocab_size = worker.vocab_size if worker is not None else engine.vocab_size
        self.stats = RankStats(self.rank, layout.role(self.rank))
        self._outbox: list[RequestOutput] = []  # decode outputs for the next report

    def check_layouts(self) -> None:
        """Every rank's KV pool must have the same block layout, or shipped blocks would not fit."""
        layouts = pd_wire.gather(self.group, pd_blocks.layout(self.cache))
        if any(other != layouts[0] for other in layouts):
            raise ConfigError(
                f"the ranks' KV layouts differ ({layouts}); start every rank with the same model and KV options"
            )

    def step(self, plan: Plan | None = None) -> list[Report] | None:
        """One lockstep step (see the module docstring); rank 0 passes the plan. Returns every rank's
        report, or None when the plan says stop."""
        plan = pd_wire.broadcast(self.group, plan)
        if plan.save or plan.stop:
            self._save_prefix_cache()
        if plan.stop:
            return None
        self._apply(plan)
        if self.worker is not None:
            self.worker.step()
        elif self.engine.has_unfinished:
            self._outbox += self.engine.step()
        reports = pd_wire.gather(self.group, self._report())
        check_reports(reports, self.layout, self.cache.block_size, self.vocab_size)
        moves = assign(reports, self.layout)
        answers = self._admit(moves)
        self._ship(moves, answers)
        if answers:  # the first tokens of the prompts just shipped reach rank 0 now, not a step later
            outboxes, self._outbox = pd_wire.gather(self.group, self._outbox), []
            for report, outputs in zip(reports, outboxes):
                report.outputs += outputs
            self._count_shipped(reports, moves, answers)
        return reports

    def _count_shipped(self, reports: list[Report], moves: list[tuple[Handoff, int]], answers: dict[str, int]) -> None:
        """Adds this step's handoffs to the counters of the reports (every rank counts the same), so
        rank 0's view is current when the step ends; this rank goes on from its counted copy."""
        for handoff, dst in moves:
            first = answers.get(handoff.request_id)
            if first is None:
                continue
            src = reports[handoff.src].stats
            src.kv_bytes_sent += (handoff.num_blocks - first) * self.block_nbytes
            src.kv_blocks_sent += handoff.num_blocks - first
            src.prompt_tokens_handed += len(handoff.prompt_token_ids)
            reports[dst].stats.kv_blocks_hit += first
        self.stats = reports[self.rank].stats

    def _save_prefix_cache(self) -> None:
        """A prefill rank writes its prefix cache file; a failure is logged, never raised: the group
        must go on in lockstep (as one process's server goes on after a failed save)."""
        if self.worker is None:
            return
        try:
            self.worker.save_prefix_cache()
        except Exception as exc:  # a full disk must not take the group down
            log.warning("rank %d could not save its prefix cache file: %s", self.rank, exc)

    def _apply(self, plan: Plan) -> None:
        for request_id in plan.abort:
            if self.worker is not None:
                self.worker.abort(request_id)
            else:
                self.engine.abort(request_id)
        if self.worker is not None:
            for rank, request_id, prompt_ids, params in plan.add:
                if rank == self.rank:
                    self.worker.add(request_id, prompt_ids, params.with_processors(self.constraints))

    def _report(self) -> Report:
        outputs, self._outbox = self._outbox, []
        handoffs = list(self.worker.ready.values()) if self.worker is not None else []
        return Report(self.rank, handoffs, outputs, self._fill_stats())

    def _fill_stats(self) -> RankStats:
        stats = self.stats
        if self.worker is not None:
            scheduler, kv = self.worker.scheduler, self.worker.kv
            stats.num_parked = len(self.worker.ready)
            stats.num_running = scheduler.num_running
        else:
            scheduler, kv = self.engine.scheduler, self.engine.kv_manager
            spec = self.engine.spec_stats()
            stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens = (
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
            )
            stats.num_running = scheduler.num_running
        stats.num_waiting = scheduler.num_waiting
        stats.num_blocks, stats.num_free_blocks = kv.num_blocks, kv.num_free_blocks
        stats.prefix_cache_queries, stats.prefix_cache_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        stats.num_preemptions = scheduler.num_preemptions
        return stats

    def _admit(self, moves: list[tuple[Handoff, int]]) -> dict[str, int]:
        """Admits this decode rank's share; returns, gathered from all decode ranks, each admitted
        request's first missing block (requests missing from it stay parked)."""
        mine: dict[str, int] = {}
        if self.engine is not None:
            for handoff, dst in moves:
                if dst == self.rank:
                    first = pd_decode.admit(self.engine, handoff, self.constraints)
                    if first is not None:
                        mine[handoff.request_id] = first
        if not moves:
            return {}
        return check_admissions(pd_wire.gather(self.group, mine), moves)

    def _ship(self, moves: list[tuple[Handoff, int]], answers: dict[str, int]) -> None:
        for handoff, dst in moves:
            first = answers.get(handoff.request_id)
            if first is None:
                continue
            num_blocks = handoff.num_blocks - first
            nbytes = num_blocks * self.block_nbytes
            data = None
            if self.rank == handoff.src and num_blocks:
                data = pd_blocks.pack(self.cache, self.worker.block_ids(handoff.request_id)[first:])
            if num_blocks:
                data = pd_wire.transfer(self.group, handoff.src, dst, nbytes, data)
            if self.rank == handoff.src:
                self.worker.release(handoff.request_id)
            if self.rank == dst:
                if num_blocks:
                    table = pd_decode.block_ids(self.engine, handoff.request_id)
                    pd_blocks.unpack(self.cache, table[first:], data)
                self._outbox += pd_decode.complete(self.engine, handoff)


def serve(node: Node) -> None:
    """A rank other than 0: steps with the group until rank 0 says stop."""
    while node.step() is not None:
        pass
