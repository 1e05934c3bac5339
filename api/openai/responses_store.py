"""Stored responses, for `previous_response_id` and GET /v1/responses/{id}: in memory, bounded.

A response made with `store` true (the default) is kept with the conversation that led to it
(its input and its output, as chat messages, without the instructions, which OpenAI does not
carry over). Entries live in this process only: at most `max_entries` of them, each for at
most `max_age_s` seconds; the oldest go first. A restart forgets them all.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 1000
MAX_AGE_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    conversation: list[dict[str, Any]]  # chat messages up to and including this response's output
    stored_at: float


class ResponseStore:
    """Responses by id, oldest first; `get` of an entry past its age drops it."""

    def __init__(
        self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._entries[response["id"]] = StoredResponse(response, conversation, self.clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= cutoff:
                return
            self._entries.popitem(last=False)
