"""ModelRunner: a scheduled step -> flattened arrays -> one forward -> sampled token ids."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.models.base import DecoderModel
from baselm.sampling import Sampler, TokenLogprobs
from baselm.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepTimings:
    """Seconds spent in each part of the last step (host and device work together)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over all scheduled tokens of a step at once, without padding.

    Every scheduled request contributes its fed tokens to one flattened batch; logits are
    computed only at the last fed position of requests that sample this step.
    """

    def __init__(self, model: DecoderModel, cache: PagedKVCache, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.timings = StepTimings()

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        input_ids, meta, sampling = self._prepare(output)
        t1 = time.perf_counter()
        logits = self.model(input_ids, meta.positions, meta, self.cache)  # (num_logits, vocab)
        mx.eval(logits)
        t2 = time.perf_counter()
        result = RunnerOutput()
        if sampling:
            requests = [s.request for s in sampling]
            sampled = self.sampler(logits, requests)
            token_ids = sampled.token_ids.tolist()
            for scheduled, token_id, logprobs in zip(sampling, token_ids, sampled.row_logprobs()):
                result.sampled_token_ids[scheduled.request_id] = [token_id]
                if logprobs is not None:
                    result.logprobs[scheduled.request_id] = logprobs
        t3 = time.perf_counter()
        self.timings = StepTimings(prepare=t1 - t0, forward=t2 - t1, sample=t3 - t2)
        return result

    def _prepare(self, output: SchedulerOutput):
        """Flattened input ids, the attention metadata, and the requests that sample."""
        input_ids: list[int] = []
        block_tables, query_lens, context_lens, logits_rows, sampling = [], [], [], [], []
        for scheduled in output.requests:
            input_ids.extend(scheduled.token_ids)
            block_tables.append(scheduled.block_ids)
            query_lens.append(scheduled.num_scheduled_tokens)
            context_lens.append(scheduled.context_len)
            if scheduled.is_sampling:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(scheduled)
        # A step where nobody samples (all mid-prefill) still needs one row to keep shapes valid.
        rows = logits_rows or [len(input_ids) - 1]
        meta = AttentionMetadata.build(block_tables, query_lens, context_lens, self.cache.block_size, rows)
        return mx.array(input_ids, dtype=mx.int32), meta, sampling
