"""Rank 0 of a prefill/decode group: the engine the server and AsyncEngine see.

`PDEngine` has LLMEngine's face (`add_request`, `step`, `abort`, `has_unfinished`, `stats`,
the tokenizer and limits), so `AsyncEngine` and the HTTP layer drive it unchanged. Behind it,
each `step` is one lockstep step of the group (pd_node.py): requests go to the prefill ranks
in the step's plan, and the outputs the decode ranks made come back in their reports.

Requests are checked here exactly as a single engine checks them (vocabulary, room, queue).
What one engine serves, a group serves too:

- n > 1: copy i of request R runs as its own request "R#i" (copy 0 as R) with the id and params
  one engine gives that copy (`copy_requests`; `for_copy`: seed + i), all on one prefill rank, whose
  prefix cache shares their prompt; their outputs come back under R with the copy's index.
- prompt logprobs: scored on the prefill rank as it computes the prompt, carried with the handoff.
- constrained output (grammars, JSON schemas, forced tool calls): processors cannot cross a
  process, so requests travel without them and with their `Constraint`, from which the rank
  that samples makes its own (the node's `constraints`, the API's maker): the prefill rank for
  the first token, the decode rank for the rest (its matcher walks over the first token first).
Only logits processors given without a constraint are refused: nothing could rebuild them.

When a rank dies, the group cannot run another collective. The requests in flight fail with
RankFailedError (the API answers 503), and rank 0 goes on serving on its own: it builds a
single-process LLMEngine on the model it already holds (`fallback`), so the server keeps
answering what it still can.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace

from baselm.config import EngineConfig
from baselm.distributed.group import RankFailedError
from baselm.distributed.pd.node import Node, Plan, RankStats
from baselm.distributed.pd.prefill import rank_prefix_file
from baselm.distributed.watchdog import Watchdog
from baselm.engine import LLMEngine, QueueFullError
from baselm.loader import LoadedModel
from baselm.outputs import copy_requests
from baselm.request import AdapterChoice, InvalidRequestError, RequestOutput
from baselm.sampling.params import ConstraintFactory, SamplingParams
from baselm.scheduler import RequestTooLongError, SchedulerStats, effective_max_tokens

log = logging.getLogger("baselm.distributed")


class PDEngine:
    """LLMEngine's interface over a prefill/decode group, on rank 0."""

    def __init__(
        self,
        node: Node,
        loaded: LoadedModel,
        config: EngineConfig,
        on_failure: Callable[[], None] | None = None,
        watchdog: Watchdog | None = None,
    ):
        """`on_failure`: called once when a rank failed (stops the ranks this process started).
        `watchdog`: armed around each step; a rank that stops answering without exiting would
        block the group's collectives forever, so its expiry should end the ranks (and with them
        the blocked collective, which then fails like any lost rank)."""
        self.node = node
        self.watchdog = watchdog
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = node.worker.max_model_len
        self.vocab_size = loaded.model.args.vocab_size
        self.prefix_file = node.worker.prefix_file  # rank 0's; every prefill rank has one or none
        self.fallback: LLMEngine | None = None  # the single-process engine after a rank failed
        self.rank_stats: list[RankStats] = []  # every rank's, from the last step
        self._on_failure = on_failure
        self._ids = itertools.count()
        self._live: set[str] = set()  # copies (requests, when n = 1) not finished yet
        self._plan = Plan()
        self._aborted: list[RequestOutput] = []  # abort outputs for the next step
        self._where: dict[str, int] = {}  # copy id -> its prefill rank, until a decode rank reports it
        self._copy_of: dict[str, tuple[str, int]] = {}  # copy id -> (user's request id, index), until it finishes
        self._copy_ids: dict[str, list[str]] = {}  # user's request id -> its copies' ids

    # ---- the prefill side's model and pool, for embeddings between steps -------------

    @property
    def kv_manager(self):
        return self.fallback.kv_manager if self.fallback is not None else self.node.worker.kv

    @property
    def runner(self):
        return self.fallback.runner if self.fallback is not None else self.node.worker.runner

    @property
    def cache(self):
        return self.fallback.cache if self.fallback is not None else self.node.worker.cache

    # ---- requests in -------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapters: AdapterChoice | None = None,
    ) -> str:
        if adapters is not None:
            raise InvalidRequestError("a prefill/decode group serves no LoRA adapters; serve the model in one process")
        if self.fallback is not None:
            return self.fallback.add_request(prompt, params, request_id)
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        check_handoff(params, self.node.constraints)
        if len(self._live) >= self.config.max_waiting + self.config.max_num_seqs * self.node.layout.num_decode:
            raise QueueFullError(f"{len(self._live)} requests are already in flight; try again shortly")
        request_id = request_id or self.new_request_id()
        prompt_ids = self._prompt_ids(request_id, prompt)
        self._check_fits(len(prompt_ids), params.max_tokens)
        copies = copy_requests(request_id, prompt_ids, params.without_processors())  # each copy's id and params
        if request_id in self._copy_ids or any(c.request_id in self._copy_of for c in copies):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rank = self._least_busy_prefill_rank()
        for index, copy in enumerate(copies):
            self._plan.add.append((rank, copy.request_id, prompt_ids, replace(copy.sampling_params, n=1)))
            self._live.add(copy.request_id)
            self._where[copy.request_id] = rank
            self._copy_of[copy.request_id] = (request_id, index)
        self._copy_ids[request_id] = [c.request_id for c in copies]
        return request_id

    def _prompt_ids(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError(f"request {request_id} has an empty prompt; give it at least one token")
        bad = next((i for i in prompt_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        return prompt_ids

    def _least_busy_prefill_rank(self) -> int:
        load = [0] * self.node.layout.num_prefill
        for rank in self._where.values():
            load[rank] += 1
        return min(range(len(load)), key=lambda r: (load[r], r))

    def _check_fits(self, num_prompt: int, max_tokens: int | None) -> None:
        """The room rule of one engine (`effective_max_tokens`) and the pools' size (all ranks' are equal)."""
        total = num_prompt + effective_max_tokens(num_prompt, max_tokens, self.max_model_len)
        kv = self.node.worker.kv
        num_blocks = -(-(total - 1) // kv.block_size)
        if num_blocks > kv.num_blocks:
            raise RequestTooLongError(
                f"the request needs up to {num_blocks} KV blocks of {kv.block_size} tokens but the cache has "
                f"only {kv.num_blocks}; lower max_tokens or give the KV cache more memory"
            )

    # ---- one step ----------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        if self.fallback is not None:
            return self.fallback.has_unfinished
        return bool(self._live or self._plan.abort or self._aborted or self._plan.save)

    def step(self) -> list[RequestOutput]:
        """One lockstep step of the group; returns the outputs the decode ranks reported."""
        if self.fallback is not None:
            return self.fallback.step()
        plan, self._plan = self._plan, Plan()
        outputs, self._aborted = self._aborted, []
        try:
            with self.watchdog.armed("a prefill/decode step") if self.watchdog is not None else nullcontext():
                reports = self.node.step(plan)
        except RankFailedError as exc:
            self._fail()
            cause = exc.__cause__ or exc
            raise RankFailedError(
                f"a process of the prefill/decode group failed ({cause}); retry: the server goes on in one process"
            ) from exc
        self.rank_stats = [report.stats for report in reports]
        for report in reports:
            outputs += [self._as_copy(out) for out in report.outputs if out.request_id in self._live]
        return outputs

    def _as_copy(self, out: RequestOutput) -> RequestOutput:
        """A decode rank's output of one copy, under the request id the user gave and the copy's index."""
        copy_id = out.request_id
        self._where.pop(copy_id, None)  # on a decode rank now: no load on its prefill rank
        out.request_id, out.index = self._copy_of[copy_id]
        if out.finished:
            self._live.discard(copy_id)
            self._forget(copy_id)
        return out

    def _forget(self, copy_id: str) -> None:
        request_id, _ = self._copy_of.pop(copy_id)
        if not any(c in self._copy_of for c in self._copy_ids.get(request_id, [])):
            self._copy_ids.pop(request_id, None)

    def sync(self) -> list[RankStats]:
        """Runs one step with nothing new, so `rank_stats` is current (tests, `base bench`)."""
        self.step()
        return self.rank_stats

    def _fail(self) -> None:
        """A rank died: forget the group, serve alone from now on."""
        log.error("a rank of the prefill/decode group failed; serving from this process alone")
        self._live.clear()
        self._where.clear()
        self._copy_of.clear()
        self._copy_ids.clear()
        config = self.config
        if self.prefix_file is not None:  # rank 0 goes on with its own file, saved as it stands
            self._save_own_prefix_cache()
            config = replace(config, prefix_cache_file=rank_prefix_file(config.prefix_cache_file, 0))
        self.node = None
        if self._on_failure is not None:
            self._on_failure()
        self.fallback = LLMEngine(self.loaded, config)
        self.prefix_file = self.fallback.prefix_file

    def _save_own_prefix_cache(self) -> None:
        try:
            self.node.worker.save_prefix_cache()
        except Exception as exc:  # as a failed save in one process: logged, the server goes on
            log.warning("could not save the prefix cache file: %s", exc)

    # ---- requests out ------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Stops every copy of a request on every rank; this step reports each finished with "abort"."""
        if self.fallback is not None:
            self.fallback.abort(request_id)
            return
        for copy_id in self._copy_ids.get(request_id, []):
            if copy_id not in self._live:
                continue
            self._live.discard(copy_id)
            self._where.pop(copy_id, None)
            self._plan.add = [a for a in self._plan.add if a[1] != copy_id]
            self._plan.abort.append(copy_id)
            index = self._copy_of[copy_id][1]
            self._aborted.append(RequestOutput(request_id, index, finished=True, finish_reason="abort"))
            self._forget(copy_id)

    def stop(self) -> bool:
        """Tells every other rank to exit its loop (the group's last collective; the prefill ranks
        save their prefix cache files first); False when there was no group left to tell."""
        if self.fallback is None and self.node is not None:
            self.node.step(Plan(stop=True))
            return True
        return False

    def save_prefix_cache(self) -> int | None:
        """Asks every prefill rank to save its prefix cache file in the next step (and `stop` saves
        them too); returns None: the ranks write their files then, not now."""
        if self.fallback is not None:
            return self.fallback.save_prefix_cache()
        if self.prefix_file is not None:
            self._plan.save = True
        return None

    def stats(self) -> SchedulerStats:
        if self.fallback is not None:
            return self.fallback.stats()
        ranks = self.rank_stats
        num_blocks = sum(s.num_blocks for s in ranks) or 1
        num_free = sum(s.num_free_blocks for s in ranks)
        stats = SchedulerStats(
            num_running=sum(s.num_running for s in ranks),
            num_waiting=sum(s.num_waiting + s.num_parked for s in ranks),
            num_used_blocks=num_blocks - num_free,
            num_free_blocks=num_free,
            kv_usage=1.0 - num_free / num_blocks,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in ranks if s.role == "prefill"),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in ranks if s.role == "prefill"),
            num_preemptions=sum(s.num_preemptions for s in ranks),
        )
        stats.spec_num_draft_tokens = sum(s.spec_num_draft_tokens for s in ranks)
        stats.spec_num_accepted_tokens = sum(s.spec_num_accepted_tokens for s in ranks)
        stats.kv_bytes_shipped = sum(s.kv_bytes_sent for s in ranks)
        stats.kv_blocks_shipped = sum(s.kv_blocks_sent for s in ranks)
        stats.kv_blocks_skipped = sum(s.kv_blocks_hit for s in ranks)
        return stats


def check_handoff(params: SamplingParams, constraints: ConstraintFactory | None) -> None:
    """What a prefill rank cannot hand to a decode rank (`constraints`: the group's maker of
    constrained requests' processors): refused with a clear error."""
    if params.constraint is None and (params.logits_processors or params.make_logits_processors is not None):
        raise InvalidRequestError(
            "custom logits processors cannot reach the processes of a --pd group; "
            "give the params a Constraint to make them from instead"
        )
    if params.constraint is not None and constraints is None:
        raise InvalidRequestError(
            "this --pd group cannot make constrained output's processors; start it with `base serve --pd`"
        )
