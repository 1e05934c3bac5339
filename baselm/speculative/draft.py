"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next tokens.

It runs on the engine thread with a paged KV cache of its own (as many blocks as the
target's). Each request has a shadow in that cache whose `num_computed_tokens` says how much
of the request the draft has seen; a proposal first catches the draft up on the request's
new tokens, then draws one token per forward, batched across requests, by the request's own
sampling parameters (so q resembles p). The distributions the drafts came from go with them
to the verification. After the step, the shadow keeps only what is still the request's text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx

from baselm.config import ConfigError
from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.kv.manager import KVCacheManager
from baselm.loader import LoadedModel
from baselm.request import Request, RequestStatus
from baselm.sampling.sampler import DRAFT_SALT, Sampler, SamplingRow
from baselm.speculative.policy import StepCost

_PROBE_TEXT = "Speculative decoding: 1, 2, 3 — naïve café, 東京, <tag> {json: true}\n"


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Raises ConfigError unless the draft's token ids mean what the target's do."""
    sizes = (draft.model.args.vocab_size, target.model.args.vocab_size)
    tokenizers = (draft.tokenizer.vocab_size, target.tokenizer.vocab_size)
    same = sizes[0] == sizes[1] and tokenizers[0] == tokenizers[1]
    if same:
        probe = list(range(0, min(sizes[0], tokenizers[0]), max(1, sizes[0] // 997)))
        same = draft.tokenizer.encode(_PROBE_TEXT) == target.tokenizer.encode(_PROBE_TEXT) and (
            draft.tokenizer.decode(probe) == target.tokenizer.decode(probe)
        )
    if not same:
        raise ConfigError(
            f"the draft model {draft.name} does not share the vocabulary of {target.name} (output rows {sizes[0]} vs "
            f"{sizes[1]}, tokenizer sizes {tokenizers[0]} vs {tokenizers[1]}); use a draft model from the same "
            "family, with the same tokenizer"
        )


class DraftModelProposer:
    """Proposes tokens with a draft model over its own paged KV cache."""

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, seed: int | None) -> None:
        self.loaded = draft
        self.model = draft.model
        self.cache = PagedKVCache.for_model(draft.model, num_blocks, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sampler = Sampler(draft.eos_token_ids, seed=None if seed is None else seed ^ DRAFT_SALT)
        self.cost = StepCost()  # seconds of one draft forward by the number of requests in it
        self._shadows: dict[str, Request] = {}

    def draft_seconds(self, num_drafts: int, num_requests: int) -> float:
        return num_drafts * self.cost.seconds(num_requests)

    def propose(self, requests: Sequence[Request], counts: Sequence[int]) -> None:
        """Sets each request's `draft_token_ids` (up to its count) and `draft_probs` (sampled requests)."""
        wanted = {r.request_id: k for r, k in zip(requests, counts) if k > 0}
        drafts: dict[str, list[int]] = {rid: [] for rid in wanted}
        probs: dict[str, list[mx.array]] = {rid: [] for rid in wanted}
        active = [r for r in requests if r.request_id in wanted]
        while active:
            fed = self._forward_round(active, drafts, probs)
            active = [r for r in fed if len(drafts[r.request_id]) < wanted[r.request_id]]
        for request in requests:
            request.draft_token_ids = drafts.get(request.request_id, [])
            sampled = probs.get(request.request_id)
            request.draft_probs = sampled if sampled and not request.sampling_params.greedy else None

    def _forward_round(
        self, active: list[Request], drafts: dict[str, list[int]], probs: dict[str, list[mx.array]]
    ) -> list[Request]:
        """One draft forward: catch each request up and draw its next draft; returns the requests fed."""
        fed, feeds = [], []
        for request in active:
            shadow = self._shadow(request)
            tokens = (request.all_token_ids + drafts[request.request_id])[shadow.num_computed_tokens :]
            if tokens and self.kv.allocate_slots(shadow, len(tokens)):
                fed.append(request)
                feeds.append((shadow, tokens))
        if not fed:
            return []
        t0 = time.perf_counter()
        ids, meta = self._batch(feeds)
        logits = self.model(ids, meta.positions, meta, self.cache)  # (num_fed, vocab)
        rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids + drafts[r.request_id]) for r in fed
        ]
        token_ids, q = self._draw(logits, rows)
        self.cost.observe(len(fed), time.perf_counter() - t0)
        for i, (request, (shadow, tokens)) in enumerate(zip(fed, feeds)):
            shadow.num_computed_tokens += len(tokens)
            drafts[request.request_id].append(token_ids[i])
            if q is not None and not request.sampling_params.greedy:
                probs[request.request_id].append(q[i])
        return fed

    def _batch(self, feeds: list[tuple[Request, list[int]]]) -> tuple[mx.array, AttentionMetadata]:
        ids: list[int] = []
        tables, query_lens, context_lens, rows = [], [], [], []
        for shadow, tokens in feeds:
            ids += tokens
            tables.append(self.kv.block_table(shadow))
            query_lens.append(len(tokens))
            context_lens.append(shadow.num_computed_tokens + len(tokens))
            rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(tables, query_lens, context_lens, self.cache.block_size, rows)
        return mx.array(ids, dtype=mx.int32), meta

    def _draw(self, logits: mx.array, rows: list[SamplingRow]) -> tuple[list[int], mx.array | None]:
        """Each row's draft: the argmax for greedy rows, a draw from q = softmax(truncated logits)
        otherwise; returns the ids and q (num_rows, vocab), None when every row is greedy."""
        params = [r.sampling_params for r in rows]
        x = self.sampler.process(logits.astype(mx.float32), rows)  # (num_rows, vocab)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return mx.argmax(x, axis=-1).tolist(), None
        scaled = self.sampler.truncate(x, params)
        noise = mx.zeros(x.shape, dtype=mx.float32)
        gumbel = self.sampler.row_random(
            rows, sampled, DRAFT_SALT, lambda shape, key: mx.random.gumbel(shape + (x.shape[1],), key=key)
        )
        noise[mx.array(sampled)] = gumbel
        token_ids = mx.argmax(scaled + noise, axis=-1)
        q = mx.softmax(scaled, axis=-1)
        mx.eval(token_ids, q)
        return token_ids.tolist(), q

    def after_step(self, requests: dict[str, Request]) -> None:
        """Keeps each shadow to what is still its request's text; frees shadows of requests that
        are gone or not running (finished, aborted, preempted)."""
        for request_id, shadow in list(self._shadows.items()):
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                self.kv.free(shadow)
                del self._shadows[request_id]
                continue
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, request.num_tokens - 1)
            self.kv.trim(shadow, shadow.num_computed_tokens)

    def _shadow(self, request: Request) -> Request:
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = self._shadows[request.request_id] = Request(request.request_id, [0])
        return shadow
