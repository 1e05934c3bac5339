"""One forward of a model over one token sequence through a fresh paged KV cache, for tests that compare logits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.models.base import DecoderModel


def prefill_logits(model: DecoderModel, ids: Sequence[int] | np.ndarray, block_size: int = 4) -> np.ndarray:
    """The logits at every position of `ids`, (len(ids), vocab). The cache's blocks are handed out in
    reverse order: the paging must not change what the model computes."""
    num_blocks = -(-len(ids) // block_size)
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size)
    meta = AttentionMetadata.build([list(reversed(range(num_blocks)))], [len(ids)], [len(ids)], block_size)
    return np.array(model(mx.array(ids), meta.positions, meta, cache))


@contextmanager
def exact_path(kernels: Any, exact: bool) -> Iterator[None]:
    """The CPU kernels on the exact (float activation) path or the integer one, then as they were."""
    before = kernels.exact_setting()
    kernels.set_exact(exact)
    try:
        yield
    finally:
        kernels.set_exact(before)
