"""The seam between the engine and a model: where each token's K/V goes and what it attends to."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


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
    ) -> AttentionMetadata:
        """Builds the metadata on the host in one pass (numpy), then hands arrays to MLX."""
        num_seqs = len(query_lens)
        if not (len(block_tables) == len(context_lens) == num_seqs) or num_seqs == 0:
            raise ValueError("block_tables, query_lens and context_lens must describe the same sequences")
        for q, c, table in zip(query_lens, context_lens, block_tables):
            if q < 1 or c < q:
                raise ValueError(f"each sequence needs 1 <= query_len <= context_len, got {q} and {c}")
            if len(table) * block_size < c:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {c} tokens")
        max_q = max(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)  # (num_seqs, max_blocks)
        for s, table in enumerate(block_tables):
            tables[s, : len(table)] = table
        q_lens = np.asarray(query_lens, dtype=np.int64)
        c_lens = np.asarray(context_lens, dtype=np.int64)
        grid = np.arange(max_q)[None, :]  # (1, max_q)
        query_pos = (c_lens - q_lens)[:, None] + grid  # (num_seqs, max_q); rows past q_len are padding
        valid = grid < q_lens[:, None]  # (num_seqs, max_q)
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        query_rows = np.where(valid, starts[:, None] + grid, 0)  # (num_seqs, max_q)
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # (num_tokens,)
        offset_in_seq = np.arange(q_lens.sum()) - np.repeat(starts, q_lens)
        token_rows = seq_of_token * max_q + offset_in_seq  # (num_tokens,)
        positions = query_pos[valid]  # (num_tokens,) in flattened order
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(
            block_size=block_size,
            positions=mx.array(positions.astype(np.int32)),
            slot_mapping=mx.array(slots.astype(np.int32)),
            block_tables=mx.array(tables),
            context_lens=mx.array(c_lens.astype(np.int32)),
            query_pos=mx.array(query_pos.astype(np.int32)),
            token_rows=mx.array(token_rows.astype(np.int32)),
            query_rows=mx.array(query_rows.reshape(-1).astype(np.int32)),
            logits_indices=None if logits_indices is None else mx.array(np.asarray(logits_indices, np.int32)),
            query_lens=tuple(int(q) for q in query_lens),
            context_lens_host=tuple(int(c) for c in context_lens),
        )
