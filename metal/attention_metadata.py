"""The seam between the engine and a model: where each token's K/V goes, what it attends to, and
which LoRA adapters its projections add (`AdapterRows`).

Defined here, in the kernel package, because the attention paths (reference and kernels) read
it and this package imports nothing from the engine; the engine builds it (`baselm.kv` exports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np


class _QueryLayout(NamedTuple):
    """Where each flattened query token sits in the padded (sequence, query) grid, on the host."""

    query_pos: np.ndarray  # (num_seqs, max_q): position of each grid cell; cells past a query_len are padding
    query_rows: np.ndarray  # (num_seqs * max_q,): flattened token feeding each grid cell (0 for padding)
    token_rows: np.ndarray  # (num_tokens,): grid cell of each flattened token
    positions: np.ndarray  # (num_tokens,): position of each flattened token in its sequence
    seq_of_token: np.ndarray  # (num_tokens,): sequence index of each flattened token

    @classmethod
    def of(cls, q_lens: np.ndarray, c_lens: np.ndarray) -> _QueryLayout:
        num_seqs, max_q = len(q_lens), int(q_lens.max())
        grid = np.arange(max_q)[None, :]  # (1, max_q)
        query_pos = (c_lens - q_lens)[:, None] + grid  # (num_seqs, max_q)
        valid = grid < q_lens[:, None]  # (num_seqs, max_q)
        starts = _starts(q_lens)
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # (num_tokens,)
        offset_in_seq = np.arange(q_lens.sum()) - np.repeat(starts, q_lens)
        return cls(
            query_pos=query_pos,
            query_rows=np.where(valid, starts[:, None] + grid, 0).reshape(-1),
            token_rows=seq_of_token * max_q + offset_in_seq,
            positions=query_pos[valid],  # in flattened order
            seq_of_token=seq_of_token,
        )


class AdapterRows(NamedTuple):
    """The flattened token rows one LoRA adapter applies to in a step, and each row's scale: the
    rows of every request that runs with the adapter (baselm/models/lora.py adds its delta)."""

    slot: int  # the adapter's slot in the model's projections (baselm/served_adapters.py)
    rows: mx.array  # (num_rows,) int32
    scales: mx.array  # (num_rows, 1) float32: the request's scale of the adapter


def _starts(q_lens: np.ndarray) -> np.ndarray:
    """(num_seqs,) first flattened row of each sequence."""
    return np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)


def _i32(a: np.ndarray) -> mx.array:
    return mx.array(np.asarray(a).astype(np.int32))


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one forward step over the flattened tokens of several sequences.

    Tokens are laid out sequence after sequence: sequence `s` owns the flattened rows
    `query_start[s] : query_start[s] + query_lens[s]`, which are its newest tokens, so its
    i-th query sits at position `context_lens[s] - query_lens[s] + i`.

    NOTE: `context_lens[s]` counts the tokens in the cache *after* this step's writes.
    """

    block_size: int
    positions: mx.array  # (num_tokens,) int32: position of each flattened token in its sequence
    slot_mapping: mx.array  # (num_tokens,) int32: pool slot (block_id * block_size + offset)
    block_tables: mx.array  # (num_seqs, max_blocks) int32, padded with block 0
    context_lens: mx.array  # (num_seqs,) int32
    query_pos: mx.array  # (num_seqs, max_query_len) int32: position of each padded query row
    token_rows: mx.array  # (num_tokens,) int32: row of each token in the padded (seq, query) grid
    query_rows: mx.array  # (num_seqs * max_query_len,) int32: flattened token feeding each grid cell
    logits_indices: mx.array | None  # (num_logits,) int32 rows whose logits are wanted; None = all
    query_lens: tuple[int, ...]  # host copies: no device sync needed to read them
    context_lens_host: tuple[int, ...]
    mask_cache: dict = field(default_factory=dict)  # attention masks of this step, shared by the layers
    # (num_seqs, max_query_len) int32: the last key position each padded query row sees, where some
    # rows see past their own position (a span of image tokens that attend both ways); None: causal.
    attend_until: mx.array | None = None
    adapter_rows: tuple[AdapterRows, ...] = ()  # LoRA adapters this step applies, one entry each; () = none

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        logits_indices: list[int] | None = None,
        *,
        two_way_spans: list[list[tuple[int, int]]] | None = None,
        adapter_rows: tuple[AdapterRows, ...] = (),
    ) -> AttentionMetadata:
        """Builds the metadata on the host in one pass (numpy), then hands arrays to MLX.

        `two_way_spans`: per sequence, position ranges [start, end) whose tokens see each other
        both ways (each wholly in the cache after this step); their queries see keys up to end - 1."""
        _check_sequences(block_tables, query_lens, context_lens, block_size)
        tables = np.zeros((len(query_lens), max(len(t) for t in block_tables)), dtype=np.int32)  # (num_seqs, max_b)
        for s, table in enumerate(block_tables):
            tables[s, : len(table)] = table
        q_lens = np.asarray(query_lens, dtype=np.int64)
        c_lens = np.asarray(context_lens, dtype=np.int64)
        layout = _QueryLayout.of(q_lens, c_lens)
        positions = layout.positions
        slots = tables[layout.seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(
            block_size=block_size,
            positions=_i32(positions),
            slot_mapping=_i32(slots),
            block_tables=mx.array(tables),
            context_lens=_i32(c_lens),
            query_pos=_i32(layout.query_pos),
            token_rows=_i32(layout.token_rows),
            query_rows=_i32(layout.query_rows),
            logits_indices=None if logits_indices is None else _i32(logits_indices),
            query_lens=tuple(int(q) for q in query_lens),
            context_lens_host=tuple(int(c) for c in context_lens),
            attend_until=_attend_until(layout.query_pos, two_way_spans),
            adapter_rows=adapter_rows,
        )

    def token_indices(self, seq_ids: np.ndarray) -> np.ndarray:
        """(tokens of seq_ids,) the flattened rows the sequences `seq_ids` own, sequence after sequence."""
        q_lens = np.asarray(self.query_lens)
        starts = _starts(q_lens)
        return np.concatenate([np.arange(starts[s], starts[s] + q_lens[s]) for s in seq_ids])

    def select(self, seq_ids: np.ndarray) -> AttentionMetadata:
        """The step of sequences `seq_ids` alone: their tokens (`token_indices(seq_ids)` here) numbered from 0,
        for attention (no adapter rows: projections run on the whole step)."""
        q_lens = np.asarray(self.query_lens, dtype=np.int64)[seq_ids]
        c_lens = np.asarray(self.context_lens_host, dtype=np.int64)[seq_ids]
        layout = _QueryLayout.of(q_lens, c_lens)
        index = _i32(seq_ids)
        return AttentionMetadata(
            block_size=self.block_size,
            positions=_i32(layout.positions),
            slot_mapping=self.slot_mapping[_i32(self.token_indices(seq_ids))],
            block_tables=self.block_tables[index],
            context_lens=self.context_lens[index],
            query_pos=_i32(layout.query_pos),
            token_rows=_i32(layout.token_rows),
            query_rows=_i32(layout.query_rows),
            logits_indices=None,
            query_lens=tuple(int(q) for q in q_lens),
            context_lens_host=tuple(int(c) for c in c_lens),
            attend_until=None if self.attend_until is None else self.attend_until[index][:, : int(q_lens.max())],
        )


def _attend_until(query_pos: np.ndarray, spans: list[list[tuple[int, int]]] | None) -> mx.array | None:
    """(num_seqs, max_q) int32: each query's own position, or end - 1 inside a two-way span; None without spans."""
    if not spans or not any(spans):
        return None
    until = query_pos.copy()  # (num_seqs, max_q)
    for s, seq_spans in enumerate(spans):
        for start, end in seq_spans:
            inside = (query_pos[s] >= start) & (query_pos[s] < end)
            until[s, inside] = end - 1
    return _i32(until)


def _check_sequences(
    block_tables: list[list[int]], query_lens: list[int], context_lens: list[int], block_size: int
) -> None:
    num_seqs = len(query_lens)
    if not (len(block_tables) == len(context_lens) == num_seqs) or num_seqs == 0:
        raise ValueError("block_tables, query_lens and context_lens must describe the same sequences")
    for q, c, table in zip(query_lens, context_lens, block_tables):
        if q < 1 or c < q:
            raise ValueError(f"each sequence needs 1 <= query_len <= context_len, got {q} and {c}")
        if len(table) * block_size < c:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {c} tokens")
