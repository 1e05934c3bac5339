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


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest suffix (max_n
    down to min_n tokens) of `token_ids`; [] when no such suffix occurred before.

    One pass finds the earlier places of the last token; the suffix is then matched backwards
    from those few places only, so a step costs one comparison over the tokens, not one per n."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    longest = min(max_n, num_tokens - 1)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence would end
    lengths = np.ones(ends.size, dtype=np.int64)  # how many suffix tokens match, ending there
    matching = np.ones(ends.size, dtype=bool)
    for d in range(1, longest):
        back = ends - d
        matching &= back >= 0
        matching[matching] = tokens[back[matching]] == tokens[num_tokens - 1 - d]
        lengths += matching
    if not ends.size or lengths.max() < min_n:
        return []
    n = int(min(lengths.max(), longest))
    starts = ends[lengths >= n] + 1  # the token after each occurrence of the n-token suffix
    # The latest occurrence followed by k whole tokens, else the earliest (the longest run after it).
    full = starts[starts + k <= num_tokens]
    start = int(full[-1] if full.size else starts[0])
    return tokens[start : start + k].tolist()


class NgramIndex:
    """`propose_ngram` for one request whose tokens only grow, kept up to date token by token.

    For each n in [min_n, max_n] a map from every n-gram that ended before the newest token to
    the positions where it ended; a proposal is then a few lookups of the newest suffix, not
    a pass over all the tokens. Proposes exactly what `propose_ngram` does.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._num_indexed = 0  # n-grams ending before this position are in `_ends`
        self._reset()

    def _reset(self) -> None:
        self._ends = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._num_indexed = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier suffix of `token_ids` (see `propose_ngram`)."""
        num_tokens = len(token_ids)
        if num_tokens - 1 < self._num_indexed:  # fewer tokens than indexed: start over
            self._reset()
        self._index(token_ids, num_tokens - 1)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            ends = self._ends[n].get(tuple(token_ids[num_tokens - n :]))
            if ends:
                # The latest occurrence followed by k whole tokens, else the earliest.
                start = next((e + 1 for e in reversed(ends) if e + 1 + k <= num_tokens), ends[0] + 1)
                return list(token_ids[start : start + k])
        return []

    def _index(self, token_ids: Sequence[int], end: int) -> None:
        """Adds the n-grams that end at positions `_num_indexed` .. end - 1."""
        for position in range(self._num_indexed, end):
            for n, ends in self._ends.items():
                if position + 1 >= n:
                    ends.setdefault(tuple(token_ids[position + 1 - n : position + 1]), []).append(position)
        self._num_indexed = max(self._num_indexed, end)
