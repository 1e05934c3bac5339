"""One log line per request, as llama-server prints its per-request timings.

`auth.Gate`, around every request, starts its `RequestLog` in the ASGI scope (`start`) and writes
the line once the response is sent (`write`): method, route, status, duration and, for a request
that generated, the model, prompt / cached / generated tokens, time to first token, decode speed
and finish reason, which `serving.outputs` records as the engine's outputs pass (`observe`). So
there is one line per request, whatever the protocol and whether it streamed, failed or was
refused. `/health` and `/metrics`, which probes call every few seconds, log at debug only.

`base serve --log-format json` writes every line (these, uvicorn's and the engine's) as one JSON
object (`JSONFormatter`); a request's fields are keys of their own there.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import Scope

if TYPE_CHECKING:
    from baselm.request import RequestOutput

logger = logging.getLogger("baselm.api.requests")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled: their lines go to debug
_SCOPE_KEY = "base.request_log"


class Usage(Protocol):
    """What the line reads of an answer's token counts (serving.Usage)."""

    completion: dict[int, int]  # choice index -> output tokens

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class RequestLog:
    """What one request's log line says; `observe` takes each engine output the answer reads."""

    method: str
    route: str
    arrival: float = field(default_factory=time.monotonic)
    status: int = 500  # until the response starts
    model: str | None = None  # set when the request reaches the engine
    usage: Usage | None = None  # the answer's token counts, filled as outputs pass
    first_token: float | None = None  # monotonic time of the first output with tokens
    last_token: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> the engine's reason

    def observe(self, out: RequestOutput) -> None:
        """Notes one output of the answer: when tokens came, and each choice's finish reason."""
        if out.token_ids:
            self.last_token = time.monotonic()
            if self.first_token is None:
                self.first_token = self.last_token
        if out.finished and out.finish_reason is not None:
            self.finish_reasons[out.index] = out.finish_reason

    def fields(self) -> dict[str, Any]:
        """The line's values by name (JSON's keys); the generation's only for a request that reached the engine."""
        values: dict[str, Any] = {"method": self.method, "route": self.route, "status": self.status}
        values["duration_ms"] = round((time.monotonic() - self.arrival) * 1000, 1)
        if self.model is None or self.usage is None:
            return values
        usage = self.usage.as_dict()
        values["model"] = self.model
        values["prompt_tokens"] = usage["prompt_tokens"]
        values["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        values["generated_tokens"] = usage["completion_tokens"]
        values["ttft_ms"] = None if self.first_token is None else round((self.first_token - self.arrival) * 1000, 1)
        values["tokens_per_s"] = self._decode_rate(usage["completion_tokens"])
        reasons = sorted(set(self.finish_reasons.values()))
        values["finish_reason"] = ",".join(reasons) if reasons else None
        return values

    def _decode_rate(self, num_generated: int) -> float | None:
        """Tokens per second after each choice's first token; None until two tokens came apart in time."""
        if self.first_token is None or self.last_token is None or self.last_token <= self.first_token:
            return None
        num_choices = max(1, len(self.usage.completion) if self.usage is not None else 1)
        return round(max(num_generated - num_choices, 0) / (self.last_token - self.first_token), 1)

    def write(self) -> None:
        """Logs the request's one line."""
        values = self.fields()
        level = logging.DEBUG if self.route in QUIET_PATHS else logging.INFO
        logger.log(level, "%s", line_text(values), extra={"fields": values})


def start(scope: Scope) -> RequestLog:
    """A new request's log, kept in its ASGI scope for the handler to fill in."""
    record = RequestLog(scope.get("method", ""), scope["path"])
    scope.setdefault("state", {})[_SCOPE_KEY] = record
    return record


def of(scope: Scope) -> RequestLog | None:
    """The log `start` kept in the scope (None for an app run without the Gate, as some tests do)."""
    return scope.get("state", {}).get(_SCOPE_KEY)


def line_text(values: dict[str, Any]) -> str:
    """The text line: 'POST /v1/chat/completions 200 model: 37 prompt tokens (32 cached), 25 generated,
    ttft 41.2 ms, 52.3 tok/s, finish stop, 512.0 ms'."""
    head = f"{values['method']} {values['route']} {values['status']}"
    if "model" not in values:
        return f"{head}, {values['duration_ms']} ms"
    ttft = "-" if values["ttft_ms"] is None else f"{values['ttft_ms']} ms"
    rate = "-" if values["tokens_per_s"] is None else f"{values['tokens_per_s']} tok/s"
    return (
        f"{head} {values['model']}: {values['prompt_tokens']} prompt tokens ({values['cached_tokens']} cached), "
        f"{values['generated_tokens']} generated, ttft {ttft}, {rate}, finish {values['finish_reason'] or '-'}, "
        f"{values['duration_ms']} ms"
    )


class JSONFormatter(logging.Formatter):
    """Each record as one JSON object: time, level, logger, message, and a request line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)
