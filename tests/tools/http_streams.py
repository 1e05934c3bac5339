"""A server process on loopback and timed streams through it: what the HTTP benchmarks share.

`ServerProcess` starts any OpenAI-compatible server (`base serve`, `llama-server`) on a free loopback
port, waits until `/health` answers 200, and stops it however the block it guards ends; a server that
does not come up is a `ServerError` that quotes the end of its log. `stream_completion` sends one
streaming `/v1/completions` request and times it; `summarize` reads a wave of such streams sent at
once as aggregate decode speed.

NOTE: decode speed counts a stream's tokens after its first one, over the time from the first stream's
first text to the last stream's end: the first token of each stream is the end of its prefill.
Token counts are the server's own (`usage.completion_tokens`), never counted from chunks, which may
hold several tokens or none.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

LOG_TAIL_LINES = 20


class ServerError(Exception):
    """A server that did not start, or answered a request wrongly: one line, then its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`command` run as a server on `port`, its output kept in a log file, as a context manager:
    entering waits until it is healthy (a ServerError quoting its log if not), leaving stops it."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300,
        stop_timeout_s: float = 30,
    ) -> None:
        self.name = name
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self.env = dict(env) if env is not None else None
        self.timeout_s = timeout_s  # to become healthy
        self.stop_timeout_s = stop_timeout_s  # to exit after SIGTERM, before SIGKILL
        self._folder = tempfile.TemporaryDirectory(prefix="server-log-")
        self.log = Path(self._folder.name) / "server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the process and returns once `/health` answers 200; a ServerError with the log's
        tail when it exits first or is not healthy within `timeout_s`."""
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.timeout_s
        while not self.is_healthy():
            if self.proc.poll() is not None:
                raise self.fail(f"{self.name} exited with status {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise self.fail(f"{self.name} was not ready within {self.timeout_s:.0f} s")
            time.sleep(0.25)

    def is_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-num_lines:])

    def stop(self) -> None:
        """Ends the process (SIGTERM, SIGKILL after `stop_timeout_s`); harmless when it never started or
        has ended."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def fail(self, reason: str) -> ServerError:
        """A ServerError saying `reason` and quoting the end of the server's log."""
        return ServerError(f"{reason}; {self.name}'s log ends:\n{self.log_tail()}")


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """One streamed answer: when it was sent, its first text came and it ended (perf_counter seconds),
    and the server's token counts."""

    sent: float
    first: float  # the first chunk with text
    last: float  # the chunk that carried finish_reason
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def stream_completion(http: httpx.Client, url: str, body: dict) -> StreamTiming:
    """POSTs `body` to `url` + /v1/completions as a stream (usage asked for) and times its chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    usage, finish_reason = None, None
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ServerError(f"/v1/completions answered {response.status_code}: {response.read().decode()[:200]}")
        for data in sse_data(response.iter_lines()):
            chunk = json.loads(data)
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if choice.get("text") and first is None:
                    first = now
                if choice.get("finish_reason"):
                    last, finish_reason = now, choice["finish_reason"]
            usage = chunk.get("usage") or usage
    missing = [what for what, got in (("text", first), ("finish_reason", last), ("usage", usage)) if got is None]
    if missing:
        raise ServerError(f"a stream ended without {' or '.join(missing)}")
    return StreamTiming(sent, first, last, usage["prompt_tokens"], usage["completion_tokens"], finish_reason)


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The `data:` payloads of server-sent-event lines, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield data


def summarize(streams: list[StreamTiming]) -> dict[str, float | int]:
    """A wave of streams sent at once: aggregate decode tok/s, all tokens over the whole wave, the
    median stream's own decode tok/s, time to first text (mean and max), and the token counts."""
    start = min(s.sent for s in streams)
    first = min(s.first for s in streams)
    last = max(s.last for s in streams)
    tokens = sum(s.completion_tokens for s in streams)
    stream_decode = [(s.completion_tokens - 1) / (s.last - s.first) if s.last > s.first else 0.0 for s in streams]
    return {
        "streams": len(streams),
        "completion_tokens": tokens,
        "prompt_tokens_mean": round(statistics.fmean(s.prompt_tokens for s in streams), 1),
        "decode_tok_s": round((tokens - len(streams)) / (last - first), 2) if last > first else 0.0,
        "aggregate_tok_s": round(tokens / (last - start), 2),
        "decode_tok_s_per_stream_median": round(statistics.median(stream_decode), 2),
        "ttft_mean_ms": round(1000 * statistics.fmean(s.first - s.sent for s in streams), 1),
        "ttft_max_ms": round(1000 * max(s.first - s.sent for s in streams), 1),
    }
