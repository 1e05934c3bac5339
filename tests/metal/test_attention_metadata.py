"""AttentionMetadata: the padded query grid of a step, and the step of some of its sequences alone."""

from __future__ import annotations

import numpy as np
import pytest

from baselm.metal.attention_metadata import AttentionMetadata

# Three sequences: a decode (context 5), a 3-token chunk (context 7), a decode (context 2); blocks of 4.
TABLES, QUERY_LENS, CONTEXT_LENS = [[2, 0], [1, 3], [4]], [1, 3, 1], [5, 7, 2]


def test_build_lays_out_the_flattened_tokens_on_a_padded_grid():
    meta = AttentionMetadata.build(TABLES, QUERY_LENS, CONTEXT_LENS, 4)
    assert (meta.num_seqs, meta.num_tokens, meta.max_query_len, meta.max_context_len) == (3, 5, 3, 7)
    assert meta.positions.tolist() == [4, 4, 5, 6, 1]
    assert meta.slot_mapping.tolist() == [0 * 4 + 0, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 4 * 4 + 1]
    assert meta.block_tables.tolist() == [[2, 0], [1, 3], [4, 0]]
    assert meta.query_pos.tolist() == [[4, 5, 6], [4, 5, 6], [1, 2, 3]]
    assert meta.token_rows.tolist() == [0, 3, 4, 5, 6]
    assert meta.query_rows.tolist() == [0, 0, 0, 1, 2, 3, 4, 0, 0]


def test_token_indices_name_the_rows_of_the_given_sequences_in_order():
    meta = AttentionMetadata.build(TABLES, QUERY_LENS, CONTEXT_LENS, 4)
    assert meta.token_indices(np.array([0, 2])).tolist() == [0, 4]
    assert meta.token_indices(np.array([1])).tolist() == [1, 2, 3]


@pytest.mark.parametrize("seq_ids", [[0, 2], [1], [0, 1, 2]])
def test_select_is_the_step_of_those_sequences_alone(seq_ids):
    selected = AttentionMetadata.build(TABLES, QUERY_LENS, CONTEXT_LENS, 4).select(np.array(seq_ids))
    alone = AttentionMetadata.build(
        [TABLES[s] for s in seq_ids], [QUERY_LENS[s] for s in seq_ids], [CONTEXT_LENS[s] for s in seq_ids], 4
    )
    for name in ("positions", "slot_mapping", "context_lens", "query_pos", "token_rows", "query_rows"):
        assert getattr(selected, name).tolist() == getattr(alone, name).tolist(), name
    width = alone.block_tables.shape[1]
    assert selected.block_tables[:, :width].tolist() == alone.block_tables.tolist()
    assert (selected.query_lens, selected.context_lens_host) == (alone.query_lens, alone.context_lens_host)
