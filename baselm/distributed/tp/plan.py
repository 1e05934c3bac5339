"""The step plan rank 0 sends every rank: what one forward needs, as one int32 buffer.

A forward's inputs are the flattened token ids and the attention metadata's host-side lists
(query and context lengths, block tables); every rank rebuilds the same `AttentionMetadata`
from them. A plan also says which cache to run on (`CACHE`: allocate pools of a size) or to
stop (`STOP`), or to save or load the prefix cache files (`SAVE`, `LOAD`: dist/tp_persist.py).
Layout, all int32 little-endian:

    [op, num_seqs, num_tokens, max_blocks, cache_id, a, b, c]   header (a, b, c: op-specific)
    query_lens (num_seqs) | context_lens (num_seqs) | input_ids (num_tokens) | block_tables (num_seqs * max_blocks)

`cache_id` names the KV cache a forward runs on: rank 0 announces each cache once (`CACHE`,
with (a, b, c) = (num_blocks, block_size, kv_bits)) and frees it (`FREE`) when it is gone.
`SAVE` and `LOAD` carry a payload of int32 words after the header (its length in num_tokens).

A plan arrives from another process: `decode` refuses one whose header does not describe its
length, and `check` one whose block ids or token ids fall outside this rank's pool and
vocabulary (MLX checks no index: a gather past an array reads other memory, a scatter writes
there), each with a MessageError, before the plan reaches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from baselm.distributed.comm import MessageError, broadcast_bytes
from baselm.kv import AttentionMetadata

FORWARD, HIDDEN, CACHE, FREE, STOP, SAVE, LOAD = 1, 2, 3, 4, 5, 6, 7
_PAYLOAD = (SAVE, LOAD)
_HEADER = 8


@dataclass(slots=True)
class StepPlan:
    """One message from rank 0: an op and, for FORWARD/HIDDEN, the forward's inputs."""

    op: int
    input_ids: np.ndarray | None = None  # (num_tokens,) int32
    query_lens: np.ndarray | None = None  # (num_seqs,) int32
    context_lens: np.ndarray | None = None  # (num_seqs,) int32
    block_tables: np.ndarray | None = None  # (num_seqs, max_blocks) int32, padded
    cache_id: int = 0
    cache_shape: tuple[int, int, int] = (0, 0, 0)  # CACHE: (num_blocks, block_size, kv_bits)
    payload: np.ndarray | None = None  # SAVE, LOAD: (n,) int32

    @classmethod
    def forward(cls, op: int, input_ids: mx.array, meta: AttentionMetadata, cache_id: int) -> StepPlan:
        """The plan of a forward rank 0 is about to run on `input_ids` and `meta`, in cache `cache_id`."""
        return cls(
            op,
            np.asarray(input_ids, dtype=np.int32),
            np.asarray(meta.query_lens, dtype=np.int32),
            np.asarray(meta.context_lens_host, dtype=np.int32),
            np.asarray(meta.block_tables, dtype=np.int32),
            cache_id,
        )

    def encode(self) -> bytes:
        if self.op in _PAYLOAD:
            header = [self.op, 0, len(self.payload), 0, self.cache_id, 0, 0, 0]
            return np.concatenate([np.asarray(header, dtype="<i4"), np.asarray(self.payload, dtype="<i4")]).tobytes()
        if self.op not in (FORWARD, HIDDEN):
            return np.array([self.op, 0, 0, 0, self.cache_id, *self.cache_shape], dtype="<i4").tobytes()
        num_seqs, max_blocks = self.block_tables.shape
        header = [self.op, num_seqs, len(self.input_ids), max_blocks, self.cache_id, 0, 0, 0]
        parts = [header, self.query_lens, self.context_lens, self.input_ids, self.block_tables.reshape(-1)]
        return np.concatenate([np.asarray(p, dtype="<i4") for p in parts]).tobytes()

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        if len(data) < 4 * _HEADER or len(data) % 4:
            raise MessageError(f"a step plan of {len(data)} bytes is not one")
        values = np.frombuffer(data, dtype="<i4")  # (8 + 2 * num_seqs + num_tokens + num_seqs * max_blocks,)
        op, num_seqs, num_tokens, max_blocks, cache_id, *extra = (int(v) for v in values[:_HEADER])
        if op not in (FORWARD, HIDDEN, CACHE, FREE, STOP, *_PAYLOAD):
            raise MessageError(f"a step plan has the unknown op {op}")
        if min(num_seqs, num_tokens, max_blocks) < 0:
            raise MessageError(
                f"a step plan has a negative count ({num_seqs} sequences, {num_tokens} tokens, {max_blocks} blocks)"
            )
        if op in _PAYLOAD:
            if len(values) != _HEADER + num_tokens or num_tokens % 5:
                raise MessageError(
                    f"a step plan holds {len(values)} values, its header describes {_HEADER + num_tokens} (5 per block)"
                )
            return cls(op, cache_id=cache_id, payload=values[_HEADER:].copy())
        if op not in (FORWARD, HIDDEN):
            return cls(op, cache_id=cache_id, cache_shape=tuple(extra))
        sizes = [num_seqs, num_seqs, num_tokens, num_seqs * max_blocks]
        if len(values) != _HEADER + sum(sizes):
            raise MessageError(f"a step plan holds {len(values)} values, its header describes {_HEADER + sum(sizes)}")
        q, c, ids, tables = np.split(values[_HEADER:], np.cumsum(sizes)[:-1])
        return cls(op, ids, q, c, tables.reshape(num_seqs, max_blocks), cache_id)

    def check(self, num_blocks: int, vocab_size: int) -> None:
        """Raises MessageError unless the plan's block ids name blocks of a pool of `num_blocks` and its
        token ids are in a vocabulary of `vocab_size` (SAVE, LOAD: the payload's block ids)."""
        ids = self.payload[: len(self.payload) // 5] if self.op in _PAYLOAD else self.block_tables
        if ids is not None and ids.size and not (0 <= ids.min() and ids.max() < num_blocks):
            raise MessageError(f"a step plan names blocks {ids.min()}..{ids.max()} of a pool of {num_blocks}")
        tokens = self.input_ids
        if tokens is not None and tokens.size and not (0 <= tokens.min() and tokens.max() < vocab_size):
            raise MessageError(
                f"a step plan holds token ids {tokens.min()}..{tokens.max()}, past a vocabulary of {vocab_size}"
            )

    def metadata(self, block_size: int) -> AttentionMetadata:
        """The attention metadata rank 0 built for this forward (logits rows aside)."""
        tables = [list(row) for row in self.block_tables]
        try:
            return AttentionMetadata.build(tables, self.query_lens.tolist(), self.context_lens.tolist(), block_size)
        except ValueError as e:  # lengths no sequence has
            raise MessageError(f"a step plan describes no step: {e}") from e


def send_plan(plan: StepPlan, group) -> None:
    """Rank 0: the plan to every rank."""
    broadcast_bytes(plan.encode(), group)


def receive_plan(group) -> StepPlan:
    """Ranks other than 0: the next plan (blocks until rank 0 sends one)."""
    return StepPlan.decode(broadcast_bytes(None, group))
