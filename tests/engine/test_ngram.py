"""The n-gram proposer against a plain reading of its rule, over many seeded random token lists."""

from __future__ import annotations

import random

from baselm.speculative.ngram import propose_ngram


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule as written: for n from max_n down to min_n, the earlier places where the last n tokens
    occurred; the k tokens after the latest place with k whole tokens after it, else after the earliest."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            full = [s for s in starts if s + k <= len(tokens)]
            start = full[-1] if full else starts[0]
            return tokens[start : start + k]
    return []


def test_the_proposer_follows_its_rule_on_random_token_lists():
    rng = random.Random(7)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 50))]
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 6), rng.randint(0, 8)
        assert propose_ngram(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_a_repeated_passage_is_proposed_from_its_latest_whole_occurrence():
    passage = [11, 12, 13, 14, 15, 16]
    tokens = passage + [99] + passage[:3]
    assert propose_ngram(tokens, 2, 5, 3) == [14, 15, 16]
    assert propose_ngram([1, 2, 3, 4], 2, 5, 3) == []
