"""The n-gram proposer (prompt lookup): guess what follows from what followed before.

The longest suffix of a request's tokens (prompt and output), from `max_n` down to
`min_n` tokens, that occurred earlier in them is looked up; the tokens that followed its
most recent earlier occurrence (with `k` tokens after it) are the proposal. Answers that
copy from the prompt (quote, edit, summarize, code changes) are proposed well; free text
mostly finds nothing, and then nothing is proposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix (max_n
    down to min_n tokens) of `token_ids`; [] when no such suffix occurred before."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Windows that start before the suffix itself: tokens[i : i + n] for i < num_tokens - n.
        windows = sliding_window_view(tokens[:-1], n)  # (num_tokens - n, n)
        hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if hits.size:
            # The latest occurrence followed by k whole tokens, else the earliest (the longest run after it).
            full = hits[hits + n + k <= num_tokens]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []
