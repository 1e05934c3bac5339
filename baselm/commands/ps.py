"""`base ps`: what a running `base serve` has loaded, asked through its Ollama API (`GET /api/ps`),
as `ollama ps` shows it: a table, or the server's answer as JSON."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from baselm.config import format_size

TIMEOUT_S = 5.0


class PsError(RuntimeError):
    """No server answered `base ps` as base does; the message says what to do."""


@dataclass(frozen=True, slots=True)
class PsArgs:
    """Which server `base ps` asks, with which key, and how it prints."""

    host: str
    port: int
    api_key: str | None = None
    as_json: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def ps(args: PsArgs) -> None:
    """Prints the models the server at `args.url` holds in memory."""
    models = running_models(args)
    if args.as_json:
        print(json.dumps({"models": models}, indent=2))
        return
    from rich.table import Table

    from baselm.commands.console import table_console

    table = Table("name", "size", "processor", "context", "quant", "format", box=None, header_style="bold")
    for model in models:
        details = model.get("details") or {}
        processor = "GPU" if model.get("size_vram") else "CPU"
        size = format_size(model.get("size", 0), "MiB", 0)
        name = model.get("name", "?")
        if details.get("parent_model"):  # a LoRA adapter: its size is what it adds to its model's
            name = f"{name} (adapter of {details['parent_model']})"
        row = (name, size, processor, str(model.get("context_length", "?")))
        table.add_row(*row, details.get("quantization_level", ""), details.get("format", ""))
    table_console().print(table)


def running_models(args: PsArgs) -> list[dict[str, Any]]:
    """The server's `/api/ps` list; a PsError in one sentence when no base server answers there."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    request = urllib.request.Request(f"{args.url}/api/ps", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        raise PsError(_refusal(args.url, exc.code)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PsError(f"no server answers at {args.url} ({reason}); start one with: base serve MODEL") from None
    except ValueError:
        raise PsError(f"{args.url}/api/ps did not answer JSON; is it a base server?") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("models"), list):
        raise PsError(f"{args.url}/api/ps answered without a list of models; is it a base server?")
    return answer["models"]


def _refusal(url: str, status: int) -> str:
    if status in (401, 403):
        return f"the server at {url} wants an API key: give --api-key KEY or set BASE_API_KEY"
    if status == 404:
        return f"{url} answers, but has no /api/ps: is it a base server?"
    return f"{url}/api/ps answered HTTP {status}; see the server's log"
