"""ModelRunner: a scheduled step -> flattened arrays -> one forward -> sampled token ids."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from baselm import prompt_logprobs
from baselm.kv import AdapterRows, AttentionMetadata, PagedKVCache
from baselm.models.base import DecoderModel, ImageEmbeddings
from baselm.prompt_logprobs import PromptRows
from baselm.sampling.acceptance import emitted_tokens
from baselm.sampling.params import TokenLogprobs
from baselm.sampling.sampler import Sampler, SamplerOutput, SamplingRow, SamplingSequence
from baselm.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class StepStats:
    """Seconds per part of a step, and what it did. The runner times its parts: the host arrays
    (prepare), the model and sampler on the device, graph building included (forward), reading
    the samples back (sample); the engine adds scheduling, the update and the counts."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0


@dataclass(slots=True)
class Launched:
    """A step whose graph is built and running: whom it samples for, and the lazy samples."""

    request_ids: list[str]
    drafts: list[list[int]]  # per sampling request: the draft ids it verifies (its rows are len + 1)
    sampled: SamplerOutput | None
    prepare_s: float  # seconds spent on the step's host arrays (ids, attention metadata)
    launch_s: float  # seconds spent building the graph and starting it (on CPU, most of the compute)
    prompt_rows: PromptRows | None = None  # prompt tokens scored this step (prompt_logprobs.py)


@dataclass(slots=True)
class RunnerOutput:
    """A finished step's sampled ids and logprobs, by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per new id, when asked for
    num_accepted: dict[str, int] = field(default_factory=dict)  # drafts accepted, for requests that verified some
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)  # by prompt position


class ModelRunner:
    """Runs the model over all scheduled tokens of a step at once, without padding.

    Every scheduled request contributes its fed tokens to one flattened batch; logits are
    computed only at the last fed position of requests that sample this step, and at each of
    the k + 1 last positions of a request that verifies k speculative tokens.
    """

    def __init__(self, model: DecoderModel, cache: PagedKVCache, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.last_step = StepStats()  # the runner's parts of the last step

    def launch(self, output: SchedulerOutput, after: Launched | None = None) -> Launched:
        """Builds the step's forward and sampling graph and starts it (`mx.async_eval`) without waiting.

        `after`: a step still running whose sampled ids this one feeds, one per request in
        order (decode pipelining, see `Scheduler.schedule_ahead`); the plan's token ids are then
        placeholders, and so is each request's newest output id the sampler sees.
        """
        t0 = time.perf_counter()
        prompt_rows = prompt_logprobs.rows(output.requests)
        ids, meta, sampling, images = self._prepare(output, prompt_rows.flat_rows)
        rows, draft_ids, draft_probs = _sampling_rows(sampling)
        if after is not None:
            ids = after.sampled.token_ids  # (num_seqs,) int32, on the device
            rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, [*r.output_token_ids, 0]) for r in rows]
        t1 = time.perf_counter()
        positions = self._positions(output, meta)
        if images is None:
            logits = self.model(ids, positions, meta, self.cache)
        else:
            logits = self.model(ids, positions, meta, self.cache, images=images)
        if prompt_rows.flat_rows:  # (sampling rows + prompt rows, vocab): the prompt's rows come last
            num_sampling_rows = sum(s.num_draft_tokens + 1 for s in sampling)
            prompt_rows.score(logits[num_sampling_rows:])
            logits = logits[:num_sampling_rows]
        sampled = None
        if sampling:
            sampled = self.sampler(logits, rows, draft_ids, draft_probs)
            mx.async_eval(
                [
                    a
                    for a in (
                        sampled.token_ids,
                        sampled.logprobs,
                        sampled.top_token_ids,
                        sampled.top_logprobs,
                        sampled.accepted,
                        sampled.residual_ids,
                        sampled.emitted_ids,
                    )
                    if a is not None
                ]
                + prompt_rows.arrays()
            )
        else:  # nobody samples, but the step's K/V writes must happen
            mx.async_eval([logits, *prompt_rows.arrays()])
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens :] for s in sampling]
        launch_s = time.perf_counter() - t1
        return Launched([s.request_id for s in sampling], drafts, sampled, t1 - t0, launch_s, prompt_rows)

    def collect(self, launched: Launched) -> RunnerOutput:
        """Waits for a launched step and returns its sampled ids and logprobs by request id."""
        t0 = time.perf_counter()
        result = RunnerOutput()
        if launched.sampled is not None and launched.sampled.accepted is not None:
            _collect_verified(launched, result)
            t1 = time.perf_counter()
        elif launched.sampled is not None:
            token_ids = launched.sampled.token_ids.tolist()
            t1 = time.perf_counter()
            for request_id, token_id, logprobs in zip(launched.request_ids, token_ids, launched.sampled.row_logprobs()):
                result.sampled_token_ids[request_id] = [token_id]
                if logprobs is not None:
                    result.logprobs[request_id] = [logprobs]
        else:
            t1 = time.perf_counter()
        if launched.prompt_rows is not None:
            result.prompt_logprobs = launched.prompt_rows.collect()
        forward = launched.launch_s + t1 - t0
        self.last_step = StepStats(prepare=launched.prepare_s, forward=forward, sample=time.perf_counter() - t1)
        return result

    def _prepare(self, output: SchedulerOutput, extra_rows: list[int]):
        """Flattened input ids, the attention metadata, the requests that sample, and the step's
        image rows (None without any); logits are wanted at each sampling request's last fed token
        (k + 1 rows when verifying k drafts), then at `extra_rows` (prompt logprobs)."""
        input_ids: list[int] = []
        block_tables, query_lens, context_lens, logits_rows, sampling = [], [], [], [], []
        image_parts: list[tuple[mx.array, mx.array]] = []
        two_way_spans: list[list[tuple[int, int]]] = []
        for scheduled in output.requests:
            if scheduled.request.images:
                image_parts += self._image_rows(scheduled, len(input_ids))
            two_way_spans.append(_two_way_spans(scheduled))
            input_ids.extend(scheduled.token_ids)
            block_tables.append(scheduled.block_ids)
            query_lens.append(scheduled.num_scheduled_tokens)
            context_lens.append(scheduled.context_len)
            if scheduled.is_sampling:
                last = len(input_ids) - 1
                logits_rows.extend(range(last - scheduled.num_draft_tokens, last + 1))
                sampling.append(scheduled)
        # A step where nobody samples (all mid-prefill) still needs one row to keep shapes valid.
        rows = logits_rows + extra_rows or [len(input_ids) - 1]
        adapters = _adapter_rows(output.requests)
        meta = AttentionMetadata.build(
            block_tables,
            query_lens,
            context_lens,
            self.cache.block_size,
            rows,
            two_way_spans=two_way_spans,
            adapter_rows=adapters,
        )
        images = None
        if image_parts:
            images = ImageEmbeddings(
                mx.concatenate([r for r, _ in image_parts]), mx.concatenate([e for _, e in image_parts])
            )
        return mx.array(input_ids, dtype=mx.int32), meta, sampling, images

    def _positions(self, output: SchedulerOutput, meta: AttentionMetadata) -> mx.array:
        """The step's rotary positions: the token indices (`meta.positions`), or for an M-RoPE model
        each request's own, (3, num_tokens), given as one row when the three agree (text, decode)."""
        if self.model.position_rows == 1:
            return meta.positions
        parts = []
        for scheduled in output.requests:
            request, start = scheduled.request, scheduled.num_computed_tokens
            index = np.arange(start, start + len(scheduled.token_ids))  # (n,)
            if request.images and request.rope_positions is None:
                request.rope_positions = self.model.rope_positions(request.num_prompt_tokens, list(request.images))
            if request.rope_positions is None:
                parts.append(np.broadcast_to(index, (3, len(index))))
                continue
            table, delta = request.rope_positions
            in_prompt = index < table.shape[1]
            part = np.broadcast_to(index + delta, (3, len(index))).copy()
            part[:, in_prompt] = table[:, index[in_prompt]]
            parts.append(part)
        positions = np.concatenate(parts, axis=1).astype(np.int32)  # (3, num_tokens)
        return mx.array(positions[0] if (positions == positions[0]).all() else positions)

    def _image_rows(self, scheduled: ScheduledRequest, first_row: int) -> list[tuple[mx.array, mx.array]]:
        """(rows, embeddings) of each image whose placeholders this step feeds, its rows counted from
        `first_row`; the vision tower runs on an image the first time its placeholders are fed, and
        its embeddings stay with the request (a preempted request recomputes without it)."""
        start, end = scheduled.num_computed_tokens, scheduled.num_computed_tokens + len(scheduled.token_ids)
        parts = []
        for image in scheduled.request.images:
            if image.end <= start or image.start >= end:
                continue
            if image.embeddings is None:
                image.embeddings = self.model.embed_image(mx.array(image.pixels), image.extra)
            fed = np.flatnonzero((image.positions >= start) & (image.positions < end))  # (n,)
            rows = mx.array((image.positions[fed] - start + first_row).astype(np.int32))
            parts.append((rows, image.embeddings[mx.array(fed.astype(np.int32))]))
        return parts


def _two_way_spans(scheduled: ScheduledRequest) -> list[tuple[int, int]]:
    """The fed images' placeholder spans that attend both ways (the scheduler feeds each whole)."""
    start, end = scheduled.num_computed_tokens, scheduled.context_len
    return [(i.start, i.end) for i in scheduled.request.images if i.bidirectional and i.start < end and start < i.end]


def _adapter_rows(requests: list[ScheduledRequest]) -> tuple[AdapterRows, ...]:
    """Each LoRA adapter the step's requests run with: the flattened rows of those requests (all
    their fed tokens, drafts included) and each row's scale; () when every request is plain."""
    rows: dict[int, list[int]] = defaultdict(list)
    scales: dict[int, list[float]] = defaultdict(list)
    start = 0
    for scheduled in requests:
        num_fed = scheduled.num_scheduled_tokens
        adapters = scheduled.request.adapters
        for slot, scale in adapters.slots if adapters is not None else ():
            rows[slot] += range(start, start + num_fed)
            scales[slot] += [scale] * num_fed
        start += num_fed
    return tuple(
        AdapterRows(slot, mx.array(rows[slot], dtype=mx.int32), mx.array(scales[slot], dtype=mx.float32)[:, None])
        for slot in sorted(rows)
    )


def _sampling_rows(
    sampling: list[ScheduledRequest],
) -> tuple[list[SamplingSequence], list[int] | None, list | None]:
    """The sampler's rows: one per sampling request, k + 1 for a request verifying k drafts (row j
    sees the drafts before it as generated, for penalties and seeds), with each row's draft id
    (-1: none) and the distribution it came from (None: a point mass); no draft lists when no
    request verifies any."""
    if not any(s.num_draft_tokens for s in sampling):
        return [s.request for s in sampling], None, None
    rows: list[SamplingSequence] = []
    draft_ids: list[int] = []
    draft_probs: list = []
    for s in sampling:
        request, k = s.request, s.num_draft_tokens
        if not k:
            rows.append(request)
            draft_ids.append(-1)
            draft_probs.append(None)
            continue
        drafts = s.token_ids[len(s.token_ids) - k :]
        probs = request.draft_probs
        for j in range(k + 1):
            rows.append(
                SamplingRow(request.sampling_params, request.prompt_token_ids, request.output_token_ids + drafts[:j])
            )
            draft_ids.append(drafts[j] if j < k else -1)
            draft_probs.append(probs[j] if probs is not None and j < k else None)
    return rows, draft_ids, draft_probs


def _collect_verified(launched: Launched, result: RunnerOutput) -> None:
    """Each request's new ids from its rows: accepted drafts, then the residual or bonus token."""
    sampled = launched.sampled
    token_ids = sampled.token_ids.tolist()
    accepted = sampled.accepted.tolist()
    residual = sampled.residual_ids.tolist()
    logprobs = sampled.row_logprobs()
    row = 0
    for request_id, drafts in zip(launched.request_ids, launched.drafts):
        k = len(drafts)
        new_ids, num_accepted = emitted_tokens(
            drafts, accepted[row : row + k], residual[row : row + k], token_ids[row + k]
        )
        result.sampled_token_ids[request_id] = new_ids
        if k:
            result.num_accepted[request_id] = num_accepted
        if logprobs[row] is not None:  # row j emitted the j-th new id
            result.logprobs[request_id] = logprobs[row : row + len(new_ids)]
        row += k + 1
