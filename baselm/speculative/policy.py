"""How many speculative tokens each request verifies in a step: measured, not guessed.

Two measurements drive it:
- `StepCost`: the seconds a step takes by the number of tokens it feeds, measured on this
  machine at start (`calibrate`) and kept up to date from real decode steps: the fastest
  recent step at each size, as a non-decreasing curve t(T). Where extra query rows are nearly
  free (a GPU, or CPU matmuls that stream each weight once for a few rows) it rises slowly;
  where they are not it does not, and it may jump where a kernel changes its path.
- `Acceptance`: each request's rate of accepted drafts, a decaying average that drifts back to
  a prior, so a request that stopped speculating tries again later; a request whose
  verifications accept nothing backs off geometrically and probes with one draft. For n-gram
  proposals the prior is itself measured: the engine keeps an `Acceptance` of all requests'
  verifications by the length of the suffix that matched, which tells drafts apart well (on
  SmolLM2's greedy answers the first draft after a 2-token match was right 36% of the time in
  free text and 67% in copied text, after a 5-token match 88% and 99%), so a request's first
  drafts are weighed on what drafts like them did, not on one guess for all.

A draft is worth verifying when it raises the step's expected tokens per second: the j-th
draft of a request with acceptance a adds a^j expected tokens, and T drafts and decodes make
the step take t(T). Drafts are ranked best first and the step verifies the run of them with
the most expected tokens per second, E(T) / t(T), if that beats verifying none by MIN_GAIN
(`plan_drafts`). With many requests E is large next to what a draft adds and the rule
switches speculation off by itself; where that happens follows from the measured t(T). A
draft model adds its own forwards to the cost (`plan_uniform`).
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections import deque
from collections.abc import Callable, Sequence

PRIOR_ACCEPTANCE = 0.6  # what a request is assumed to accept before it has verified anything
PRIOR_WEIGHT = 2.0  # in verified drafts
DECAY = 0.8  # per verification: recent drafts count most
IDLE_DECAY = 0.97  # per step without drafts: evidence fades slowly, so a request that stopped tries again later
# The expected tokens per second a plan must beat verifying nothing by. Its inputs are estimates
# (a request's next drafts may accept well below its average), and plans promising 2-8% more were
# measured to lose ~1% on SmolLM2's free answers at 8 streams; copied text promises far more.
MIN_GAIN = 1.10
# What all requests' verifications showed, by match length, is a workload's, not one answer's: it
# remembers ~50 verifications (DECAY's ~5) and fades by half in ~700 steps without one.
SHARED_DECAY = 0.98
SHARED_IDLE_DECAY = 0.999
MAX_BACKOFF = 64  # steps: after m verifications in a row that accepted nothing, a request waits min(2^m, this)


class StepCost:
    """Seconds per step by tokens fed, from the fastest recent measurement at each size.

    Each size keeps the fastest of its last `window` measurements (the machine may be shared:
    noise only adds, so the minimum is the step's own cost; a long window keeps a size that is
    measured every step from looking slower, in a burst of load, than sizes measured earlier).
    `seconds(T)` reads the curve those minima draw, made non-decreasing from above (a step of
    T tokens costs no more than the fastest measured step of T or more tokens: a slow size does
    not raise it) and interpolated between sizes; it is not a line because the kernels are
    not: up to a few rows share one pass over the weights, and past that each row costs more.
    Beyond the largest size measured it follows the Theil-Sen line through the minima (median
    of the pairwise slopes), which `line()` also reports as a + b * T.
    """

    def __init__(self, window: int = 128) -> None:
        self.window = window
        self._samples: dict[int, deque[float]] = {}
        self._fastest: dict[int, float] = {}  # the fastest of each size's samples
        self._calibrated: set[int] = set()  # sizes measured only by calibration so far
        self._line: tuple[float, float] | None = None  # (a, b), rebuilt lazily
        self._curve: tuple[list[int], list[float]] | None = None  # sizes and their envelope, rebuilt lazily

    def observe(self, num_tokens: int, seconds: float, calibration: bool = False) -> None:
        """One step's seconds. `calibration`: a start-up step of one sequence, which can be cheaper
        than a real step of as many tokens over several sequences; it stands for its size only
        until a real step of that size is measured."""
        if num_tokens < 1 or seconds <= 0:
            return
        if calibration:
            if num_tokens in self._samples and num_tokens not in self._calibrated:
                return  # real steps of this size are known
            self._calibrated.add(num_tokens)
        elif num_tokens in self._calibrated:  # the first real step of this size replaces the calibration's
            self._calibrated.discard(num_tokens)
            del self._samples[num_tokens], self._fastest[num_tokens]
            self._line = self._curve = None
        samples = self._samples.get(num_tokens)
        if samples is None:
            samples = self._samples[num_tokens] = deque(maxlen=self.window)
        fastest = self._fastest.get(num_tokens, float("inf"))
        dropped = samples[0] if len(samples) == self.window else None
        samples.append(seconds)
        if seconds < fastest:  # the curve moves only when a size's fastest does
            self._fastest[num_tokens] = seconds
            self._line = self._curve = None
        elif dropped == fastest:
            self._fastest[num_tokens] = min(samples)
            self._line = self._curve = None

    @property
    def is_known(self) -> bool:
        return bool(self._samples)

    def seconds(self, num_tokens: int) -> float:
        """Estimated seconds of a step of `num_tokens` tokens (0 when nothing is measured yet)."""
        if not self._samples:
            return 0.0
        sizes, envelope = self._envelope()
        i = bisect.bisect_left(sizes, num_tokens)
        if i == len(sizes):
            return envelope[-1] + self.line()[1] * (num_tokens - sizes[-1])
        if sizes[i] == num_tokens or i == 0:
            return envelope[i]
        share = (num_tokens - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return envelope[i - 1] + share * (envelope[i] - envelope[i - 1])

    def _envelope(self) -> tuple[list[int], list[float]]:
        if self._curve is None:
            sizes = sorted(self._samples)
            envelope = [self._fastest[size] for size in sizes]
            for i in range(len(sizes) - 2, -1, -1):
                envelope[i] = min(envelope[i], envelope[i + 1])
            self._curve = (sizes, envelope)
        return self._curve

    def line(self) -> tuple[float, float]:
        """(a, b) of t(T) = a + b * T; with one size measured, b = 0."""
        if self._line is None:
            points = sorted(self._fastest.items())
            slopes = [(tj - ti) / (sj - si) for i, (si, ti) in enumerate(points) for sj, tj in points[i + 1 :]]
            slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
            intercept = statistics.median(t - slope * size for size, t in points)
            self._line = (max(intercept, 1e-9), slope)
        return self._line

    def table(self) -> dict[int, float]:
        """The fastest measurement at each size, for reports."""
        return dict(sorted(self._fastest.items()))


class Acceptance:
    """A request's acceptance rate: accepted over verified drafts, decaying, with a prior.

    NOTE: probing backs off. After m verifications in a row that accepted nothing the request
    proposes nothing for min(2^m, MAX_BACKOFF) steps, then tries one draft (a cheap probe);
    one accepted draft ends the back-off. Free text thus costs a few one-draft probes in a
    long answer, not a probe whenever the decaying rate drifts back to the prior.
    """

    __slots__ = ("accepted", "verified", "num_misses", "wait", "step", "decay", "idle_decay")

    def __init__(self, decay: float = DECAY, idle_decay: float = IDLE_DECAY) -> None:
        self.decay, self.idle_decay = decay, idle_decay  # per verification, per step without one
        self.accepted = 0.0
        self.verified = 0.0
        self.num_misses = 0  # verifications in a row that accepted nothing
        self.wait = 0  # steps left before the next probe
        self.step = 0  # the owner's step count this is up to date with (see `idle`)

    @property
    def rate(self) -> float:
        return self.rate_with(PRIOR_ACCEPTANCE)

    def rate_with(self, prior: float) -> float:
        """The rate with `prior` in place of PRIOR_ACCEPTANCE (what is known of drafts like these)."""
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.verified + PRIOR_WEIGHT)

    @property
    def is_waiting(self) -> bool:
        return self.wait > 0

    def max_drafts(self, k: int) -> int:
        """At most k drafts, one while probing after a miss."""
        return 1 if self.num_misses else k

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One step: `num_drafts` proposed and `num_accepted` accepted (0 and 0 when none were verified).

        Drafts after the first rejection were never tested, so they do not count as verified.
        """
        decay = self.decay if num_drafts else self.idle_decay
        self.accepted = self.accepted * decay + num_accepted
        self.verified = self.verified * decay + min(num_drafts, num_accepted + 1)
        if not num_drafts:
            self.wait = max(0, self.wait - 1)
        elif num_accepted:
            self.num_misses = self.wait = 0
        else:
            self.num_misses += 1
            self.wait = min(2**self.num_misses, MAX_BACKOFF)

    def idle(self, num_steps: int) -> None:
        """`num_steps` steps without drafts at once: as many `observe(0, 0)`."""
        if num_steps > 0:
            decay = self.idle_decay**num_steps
            self.accepted *= decay
            self.verified *= decay
            self.wait = max(0, self.wait - num_steps)


def expected_tokens(rate: float, num_drafts: int) -> float:
    """Tokens a verification of `num_drafts` drafts emits on average: 1 + a + a^2 + ... + a^k."""
    return sum(rate**j for j in range(num_drafts + 1))


def plan_drafts(
    rates: Sequence[float], max_drafts: Sequence[int], base_tokens: int, cost: StepCost, num_others: int = 0
) -> list[int]:
    """Drafts per request (0 to max_drafts[i]) for a step that already feeds `base_tokens`, one
    emitted token per request and per each of `num_others` other decoding requests (they emit
    their token whatever is verified beside them, so they weigh in the step's yield).

    Drafts are taken best first (request i's j-th adds rates[i]^j expected tokens), and of
    those runs the one with the most expected tokens per second wins, by at least MIN_GAIN over
    verifying none (else none: a near tie is not worth the risk of a wrong estimate). Every run
    is looked at, not only while each draft pays for itself, because the step cost is not
    convex: a row past the kernels' few-row pass costs more than the rows after it."""
    counts = [0] * len(rates)
    if not cost.is_known:
        return counts
    heap = [(-rate, i, 1) for i, rate in enumerate(rates) if max_drafts[i] > 0 and rate > 0]
    heapq.heapify(heap)
    expected = float(len(rates) + num_others)
    best_rate = MIN_GAIN * expected / cost.seconds(base_tokens)
    best: list[int] = []
    taken: list[int] = []
    while heap:
        neg_gain, i, j = heapq.heappop(heap)
        taken.append(i)
        expected -= neg_gain
        rate = expected / cost.seconds(base_tokens + len(taken))
        if rate > best_rate:
            best_rate, best = rate, list(taken)
        if j < max_drafts[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i, j + 1))
    for i in best:
        counts[i] += 1
    return counts


def plan_uniform(
    rates: Sequence[float],
    max_drafts: Sequence[int],
    base_tokens: int,
    cost: StepCost,
    draft_seconds: Callable[[int, int], float],
    num_others: int = 0,
) -> list[int]:
    """Drafts per request when every draft costs a forward of a draft model shared by the batch:
    the one k (capped per request) with the most expected tokens per second, counting
    `draft_seconds(k, num_requests)` for the proposing forwards and one token for each of
    `num_others` other decoding requests; 0 when none beats not speculating."""
    best_k, best = 0, 0.0
    for k in range(max(max_drafts, default=0) + 1):
        counts = [min(k, m) for m in max_drafts]
        seconds = cost.seconds(base_tokens + sum(counts)) + (draft_seconds(k, len(rates)) if k else 0.0)
        tokens = num_others + sum(expected_tokens(rate, c) for rate, c in zip(rates, counts))
        if seconds > 0 and tokens / seconds > best * (MIN_GAIN if not best_k else 1.0001):
            best_k, best = k, tokens / seconds
    return [min(best_k, m) for m in max_drafts]
