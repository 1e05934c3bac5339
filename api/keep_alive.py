"""Ollama's `keep_alive`: how long a model stays loaded after a request, read as Ollama reads it.

A number is seconds; a string is a Go duration ("5m", "1h30m", "90s") or a number of seconds
("300"; baselm/duration.py). 0 unloads the model once the request's answer is done; a negative
value keeps it loaded for ever (None here). Anything else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from baselm.api.errors import bad_request
from baselm.duration import parse_duration

DEFAULT_KEEP_ALIVE = 300.0  # seconds: Ollama's five minutes


def parse_keep_alive(value: Any, field: str = "keep_alive") -> float | None:
    """Seconds to keep a model loaded after its last request; None: for ever; 0: unload at once."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad_request(f'{field} must be a duration such as "5m" or a number of seconds', field)
    try:
        seconds = value if not isinstance(value, str) else parse_duration(value)
    except ValueError as exc:
        raise bad_request(f"{field} {exc}", field) from None
    return None if seconds < 0 else float(seconds)
