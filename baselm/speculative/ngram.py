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

    One map from each `min_n`-gram that ended before the newest token to the positions where it
    ended. A step adds one n-gram and looks up one: free text, whose newest `min_n` tokens have
    not occurred before, costs those two lookups and nothing else. When they have, each earlier
    place is extended backwards up to `max_n` tokens, which finds the longest suffix that
    occurred. Proposes exactly what `propose_ngram` does.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._num_indexed = 0  # n-grams ending before this position are in `_ends`
        self.match_length = 0  # the length of the suffix the last proposal followed (0: none)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier suffix of `token_ids` (see `propose_ngram`)."""
        num_tokens, min_n = len(token_ids), self.min_n
        self.match_length = 0
        if num_tokens - 1 < self._num_indexed:  # fewer tokens than indexed: start over
            self._ends, self._num_indexed = {}, 0
        if self._num_indexed < num_tokens - 1:
            self._index(token_ids, num_tokens - 1)
        if k < 1 or num_tokens < min_n + 1:
            return []
        ends = self._ends.get(tuple(token_ids[num_tokens - min_n :]))
        if not ends:
            return []
        longest = min(self.max_n, num_tokens - 1)
        lengths = [_match_length(token_ids, end, min_n, longest) for end in ends]
        n = self.match_length = max(lengths)
        starts = [end + 1 for end, length in zip(ends, lengths) if length == n]
        # The latest occurrence followed by k whole tokens, else the earliest.
        start = next((s for s in reversed(starts) if s + k <= num_tokens), starts[0])
        return list(token_ids[start : start + k])

    def _index(self, token_ids: Sequence[int], end: int) -> None:
        """Adds the n-grams that end at positions `_num_indexed` .. end - 1."""
        n, ends = self.min_n, self._ends
        for position in range(max(self._num_indexed, n - 1), end):
            ends.setdefault(tuple(token_ids[position + 1 - n : position + 1]), []).append(position)
        self._num_indexed = max(self._num_indexed, end)


def _match_length(token_ids: Sequence[int], end: int, matched: int, longest: int) -> int:
    """How many tokens ending at `end` equal the suffix of `token_ids` (`matched` known to), up to `longest`."""
    last = len(token_ids) - 1
    while matched < longest and end - matched >= 0 and token_ids[end - matched] == token_ids[last - matched]:
        matched += 1
    return matched
