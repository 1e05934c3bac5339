"""When a request stops, and which of its text is safe to stream.

One `StopChecker` per request sees each new token id with its detokenized text delta
and decides: stop token ids and eos ("stop"), stop strings ("stop"), `max_tokens`
("length"). Stop strings are matched across token boundaries; the text that could still
turn out to be the start of a stop string is held back, so a streaming client never
receives text that a later token makes part of a stop string.

Rules:
- `min_tokens`: the first `min_tokens` tokens never stop the request, and their text is
  emitted as it comes; stop strings are searched in the text that follows.
- A stop string ends the output where it begins (or where it ends, with
  `include_stop_str_in_output`). When several match, the one completed first wins, as if
  the text arrived one character at a time, so the result does not depend on how the
  text is split into tokens.
- The text of a stop token id or eos is dropped unless `include_stop_str_in_output`.
- With `ignore_eos`, eos is an ordinary token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from baselm.sampling.params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(slots=True)
class StopUpdate:
    """What one token changed: the text safe to emit now and, when finished, why."""

    text: str
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for eos and length


class StopChecker:
    """Stop decisions and held-back text for one request.

    `max_tokens` caps the output length on top of `params.max_tokens` (the engine passes
    what the context still has room for); None leaves `params.max_tokens` alone.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int | None = None,
    ) -> None:
        self.params = params
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids) | eos
        limits = [m for m in (params.max_tokens, max_tokens) if m is not None]
        self.max_tokens: int | None = min(limits) if limits else None
        self._stops = tuple(params.stop)
        self._pending = ""  # text held back: a suffix that may begin a stop string
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted."""
        return self._pending

    def update(self, token_id: int, text: str) -> StopUpdate:
        """Takes the next generated token and its text delta; returns what may be emitted now."""
        if self.is_finished:
            raise RuntimeError(f"the request already finished ({self.finish_reason}); it takes no more tokens.")
        can_stop = self.num_tokens >= self.params.min_tokens
        self.num_tokens += 1
        if can_stop and token_id in self._stop_ids:
            kept = text if self.params.include_stop_str_in_output else ""
            reason = token_id if token_id in self.params.stop_token_ids else None
            return self._finish(FINISH_STOP, reason, self.flush() + kept)
        if not can_stop or not self._stops:
            emitted = self.flush() + text
        else:
            self._pending += text
            emitted = self._match_stop_strings()
            if self.is_finished:
                return StopUpdate(emitted, self.finish_reason, self.stop_reason)
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._finish(FINISH_LENGTH, None, emitted + self.flush())
        return StopUpdate(emitted)

    def flush(self) -> str:
        """Releases the held-back text (when the request ends for a reason other than a stop string)."""
        text, self._pending = self._pending, ""
        return text

    def _match_stop_strings(self) -> str:
        """Finishes on a complete stop string, else emits all but the suffix that may begin one."""
        hit = self._first_complete_stop()
        if hit is not None:
            start, stop = hit
            end = start + len(stop) if self.params.include_stop_str_in_output else start
            emitted = self._pending[:end]
            self._pending = ""
            self._finish(FINISH_STOP, stop, emitted)
            return emitted
        num_held = self._num_held()
        cut = len(self._pending) - num_held
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        return emitted

    def _first_complete_stop(self) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; the longer one on a tie."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = self._pending.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None or candidate < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _num_held(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        for size in range(min(len(text), max(len(s) for s in self._stops) - 1), 0, -1):
            suffix = text[-size:]
            if any(s.startswith(suffix) for s in self._stops):
                return size
        return 0

    def _finish(self, reason: str, stop_reason: int | str | None, text: str) -> StopUpdate:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return StopUpdate(text, reason, stop_reason)
