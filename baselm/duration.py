"""Durations as Go (and so Ollama) writes them: "5m", "1h30m", "90s", "1.5h", "300ms", or a plain
number of seconds; a leading "-" makes them negative."""

from __future__ import annotations

import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds of a duration; a ValueError saying how to write one for anything else."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f'{text!r} is not a duration; write it as "5m", "1h30m" or a number of seconds')
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)


def describe_duration(seconds: float | None) -> str:
    """A duration as a person reads it: 'for ever' (None), '5m', '2h', '90s'."""
    if seconds is None:
        return "for ever"
    if seconds and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
