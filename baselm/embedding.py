"""Embeddings: a decoder model's final hidden states over whole inputs, pooled to one vector each.

An embedding request is cut once, when it is added, into slices: runs of whole inputs that fit
the step budget (`max_num_batched_tokens` tokens) and the KV pool. `EmbeddingQueue.step` runs
one slice: it borrows free blocks of the engine's own KV pool for the slice's keys and values,
runs one forward over it, and gives the blocks back. The engine thread runs one slice between
each two generation steps (`AsyncEngine`), so a request with thousands of inputs delays a
running stream's next token by one slice at most, as a prefill chunk would, and a request that
is aborted (its client disconnected) loses only the slices it had not run. No request's cache
is touched (a free block that held a cached prefix may be evicted, as any allocation would).

Why slices and not engine requests: an embedding samples nothing and keeps no K/V past its
forward, and its vectors must not depend on what else runs. A slice holds whole inputs and
only embedding inputs, cut by the budget alone, so a vector is the same on a busy server as on
an idle one; its tokens mixed into a generation batch would change the rows its matmuls see
(the CPU kernels change paths with the row count) and split long inputs across steps.

Pooling: `mean` averages every token's final normed hidden state; `last` takes the last
token's, which is what decoder models trained for embeddings (e5-mistral, gte-Qwen, Qwen3
Embedding) read. A causal LM sees only earlier tokens at each position, so `last` is the only
state that saw the whole input; for chat models that were never trained for embeddings, the
mean is the steadier choice, and the default.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.kv import AttentionMetadata

POOLINGS = ("mean", "last")
MAX_INPUTS = 2048  # inputs in one request, as OpenAI's limit


class EmbeddingError(ValueError):
    """An input the engine cannot embed (empty, too long for the model or the KV pool, too many)."""


def default_pooling(config: dict[str, Any]) -> str:
    """`last` for checkpoints saved as bare encoders of a decoder (architectures ending in `Model`,
    as embedding models are published), `mean` for causal LMs (`...ForCausalLM`)."""
    architectures = config.get("architectures") or []
    if architectures and all(not a.endswith("ForCausalLM") and a.endswith("Model") for a in architectures):
        return "last"
    return "mean"


def check_num_inputs(num_inputs: int) -> None:
    """NOTE: the one rule for how many inputs a request may hold; the API checks it before tokenizing."""
    if num_inputs > MAX_INPUTS:
        raise EmbeddingError(f"the request holds {num_inputs} inputs; the limit is {MAX_INPUTS} per request")


@dataclass(slots=True)
class EmbeddingRequest:
    """One request's inputs, cut into slices, and the vectors of the slices that ran."""

    request_id: str
    inputs: list[list[int]]
    pooling: str
    normalize: bool
    slices: list[range]  # indices into inputs, one forward each
    vectors: list[np.ndarray] = field(default_factory=list)  # float32 (hidden,), one per input run so far
    num_slices_done: int = 0
    error: Exception | None = None  # what failed it (a bug), if anything did

    @property
    def is_finished(self) -> bool:
        return self.error is not None or self.num_slices_done == len(self.slices)


class EmbeddingQueue:
    """The embedding requests of one engine, run a slice at a time, in turn (call it on the engine thread).

    `engine`: an LLMEngine, or anything with its `config`, `max_model_len`, `kv_manager`,
    `runner` and `cache` (PDEngine: rank 0's prefill side), read at each slice.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: dict[str, EmbeddingRequest] = {}  # every unfinished request
        self._turns: deque[str] = deque()  # request ids; the first runs the next slice

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add(self, request_id: str, inputs: Sequence[Sequence[int]], pooling: str, normalize: bool) -> EmbeddingRequest:
        """Queues a request; raises EmbeddingError, before any work, for inputs that cannot be embedded."""
        if request_id in self.requests:
            raise ValueError(f"an embedding request with id {request_id!r} is already queued")
        inputs = [list(ids) for ids in inputs]
        self._check(inputs, pooling)
        request = EmbeddingRequest(request_id, inputs, pooling, normalize, self._cut(inputs))
        self.requests[request_id] = request
        self._turns.append(request_id)
        return request

    def abort(self, request_id: str) -> None:
        """Drops a request and its slices not run yet; an unknown or finished id is ignored."""
        if self.requests.pop(request_id, None) is not None:
            self._turns.remove(request_id)

    def step(self) -> EmbeddingRequest | None:
        """Runs the next slice of the request whose turn it is, which then goes to the back of the
        line; returns that request (finished once its last slice ran or a slice failed), or None when
        nothing ran: no request waits, or the pool has too few free blocks for the slice now.

        NOTE: a slice that cannot get its blocks waits, as a waiting request does: they are held by
        running requests, which free them as they finish (a slice never needs more than the pool has).
        """
        if not self._turns:
            return None
        request = self.requests[self._turns[0]]
        try:
            if not self._run_slice(request):
                return None
        except Exception as exc:  # a bug: fail this request alone, keep serving
            request.error = exc
        self._turns.rotate(-1)
        if request.is_finished:
            self.abort(request.request_id)
        return request

    def _run_slice(self, request: EmbeddingRequest) -> bool:
        batch = [request.inputs[i] for i in request.slices[request.num_slices_done]]
        vectors = _embed_batch(self.engine, batch, request.pooling)
        if vectors is None:
            return False
        if request.normalize:
            vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        request.vectors += vectors
        request.num_slices_done += 1
        return True

    def _check(self, inputs: list[list[int]], pooling: str) -> None:
        if pooling not in POOLINGS:
            raise EmbeddingError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        check_num_inputs(len(inputs))
        block_size, num_blocks = self.engine.kv_manager.block_size, self.engine.kv_manager.pool.num_blocks
        max_model_len = self.engine.max_model_len
        for ids in inputs:
            if not ids:
                raise EmbeddingError("an input is empty; give it at least one token")
            if len(ids) > max_model_len:
                raise EmbeddingError(f"an input has {len(ids)} tokens; this model reads at most {max_model_len}")
            if math.ceil(len(ids) / block_size) > num_blocks:
                raise EmbeddingError(
                    f"an input has {len(ids)} tokens, more than the KV cache's {num_blocks} blocks of {block_size} "
                    "hold; give the KV cache more memory"
                )

    def _cut(self, inputs: list[list[int]]) -> list[range]:
        """Runs of whole inputs, each within the step budget (an input longer than it runs alone) and the pool."""
        budget = max(self.engine.config.max_num_batched_tokens, 1)
        block_size, num_blocks = self.engine.kv_manager.block_size, self.engine.kv_manager.pool.num_blocks
        slices, start, num_tokens, num_needed = [], 0, 0, 0
        for i, ids in enumerate(inputs):
            blocks = math.ceil(len(ids) / block_size)
            if i > start and (num_tokens + len(ids) > budget or num_needed + blocks > num_blocks):
                slices.append(range(start, i))
                start, num_tokens, num_needed = i, 0, 0
            num_tokens += len(ids)
            num_needed += blocks
        slices.append(range(start, len(inputs)))
        return slices


def embed(engine: Any, inputs: Sequence[Sequence[int]], pooling: str, normalize: bool) -> list[np.ndarray]:
    """One float32 vector per input, every slice at once (an LLMEngine's model and pool, outside a
    serving loop: the server's engine thread runs slices between steps instead)."""
    queue = EmbeddingQueue(engine)
    request = queue.add("embed", inputs, pooling, normalize)
    while not request.is_finished:
        if queue.step() is None:
            pool = engine.kv_manager.pool
            raise EmbeddingError(
                f"the KV pool has {pool.num_free_blocks} free blocks, too few for these inputs; "
                "retry when fewer requests are running, or send fewer inputs at once"
            )
    if request.error is not None:
        raise request.error
    return request.vectors


def _embed_batch(engine: Any, batch: list[list[int]], pooling: str) -> list[np.ndarray] | None:
    """One forward over `batch` in borrowed pool blocks, which then go back; None when too few are free."""
    block_size = engine.kv_manager.block_size
    pool = engine.kv_manager.pool
    needed = [math.ceil(len(ids) / block_size) for ids in batch]
    if sum(needed) > pool.num_free_blocks:
        return None
    blocks = pool.allocate(sum(needed))
    try:
        tables, start = [], 0
        for n in needed:
            tables.append([b.block_id for b in blocks[start : start + n]])
            start += n
        lens = [len(ids) for ids in batch]
        meta = AttentionMetadata.build(tables, lens, lens, block_size)
        flat = mx.array([t for ids in batch for t in ids], dtype=mx.int32)
        hidden = engine.runner.model.hidden_states(flat, meta.positions, meta, engine.cache)  # (tokens, hidden)
        pooled = _pool(hidden.astype(mx.float32), lens, pooling)  # (len(batch), hidden)
        mx.eval(pooled)
        return list(np.array(pooled))
    finally:
        pool.free(blocks)


def _pool(hidden: mx.array, lens: list[int], pooling: str) -> mx.array:
    ends = np.cumsum(lens)
    if pooling == "last":
        return hidden[mx.array(ends - 1, dtype=mx.int32)]
    starts = ends - np.asarray(lens)
    return mx.stack([hidden[int(s) : int(e)].mean(axis=0) for s, e in zip(starts, ends)])
