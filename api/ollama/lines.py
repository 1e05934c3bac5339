"""Ollama's wire details every route shares: one JSON object a line (NDJSON), times in RFC 3339."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any


def line(payload: dict[str, Any]) -> str:
    """`payload` as one NDJSON line, compact and with its newline."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
