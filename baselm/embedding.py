"""Embeddings: a decoder model's final hidden states over whole inputs, pooled to one vector each.

`embed` runs on the engine thread, between steps (`AsyncEngine.run_on_engine`): it borrows free
blocks of the engine's own KV pool for the inputs' keys and values, runs one forward over as
many inputs as the step budget holds, and gives the blocks back. No request's cache is touched
(a free block that held a cached prefix may be evicted, as any allocation would).

Pooling: `mean` averages every token's final normed hidden state; `last` takes the last
token's, which is what decoder models trained for embeddings (e5-mistral, gte-Qwen, Qwen3
Embedding) read. A causal LM sees only earlier tokens at each position, so `last` is the only
state that saw the whole input; for chat models that were never trained for embeddings, the
mean is the steadier choice, and the default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.kv import AttentionMetadata

POOLINGS = ("mean", "last")


class EmbeddingError(ValueError):
    """An input the engine cannot embed now (too long for the model or the free KV blocks)."""


def default_pooling(config: dict[str, Any]) -> str:
    """`last` for checkpoints saved as bare encoders of a decoder (architectures ending in `Model`,
    as embedding models are published), `mean` for causal LMs (`...ForCausalLM`)."""
    architectures = config.get("architectures") or []
    if architectures and all(not a.endswith("ForCausalLM") and a.endswith("Model") for a in architectures):
        return "last"
    return "mean"


def embed(engine: Any, inputs: Sequence[Sequence[int]], pooling: str, normalize: bool) -> list[np.ndarray]:
    """One float32 vector per input (an LLMEngine's model and pool; call it on the engine thread)."""
    if pooling not in POOLINGS:
        raise EmbeddingError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    budget = max(engine.config.max_num_batched_tokens, 1)
    vectors: list[np.ndarray] = []
    batch: list[Sequence[int]] = []
    batch_tokens = 0
    for ids in inputs:
        if not ids:
            raise EmbeddingError("an input is empty; give it at least one token")
        if len(ids) > engine.max_model_len:
            raise EmbeddingError(f"an input has {len(ids)} tokens; this model reads at most {engine.max_model_len}")
        if batch and batch_tokens + len(ids) > budget:
            vectors += _embed_batch(engine, batch, pooling)
            batch, batch_tokens = [], 0
        batch.append(ids)
        batch_tokens += len(ids)
    if batch:
        vectors += _embed_batch(engine, batch, pooling)
    if normalize:
        vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
    return vectors


def _embed_batch(engine: Any, batch: list[Sequence[int]], pooling: str) -> list[np.ndarray]:
    """One forward over `batch` in borrowed pool blocks, then the blocks go back."""
    block_size = engine.kv_manager.block_size
    pool = engine.kv_manager.pool
    needed = [math.ceil(len(ids) / block_size) for ids in batch]
    if sum(needed) > pool.num_free_blocks:
        raise EmbeddingError(
            f"the KV pool has {pool.num_free_blocks} free blocks and these inputs need {sum(needed)}; "
            "retry when fewer requests are running, or send fewer inputs at once"
        )
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
