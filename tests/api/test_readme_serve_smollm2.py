"""Every server example in the README (its `base serve` line, its curl request, its Python `openai`
snippets) run as written against the real SmolLM2, only the port changed (and the model given as
its GGUF file, served under the README's name, since the test's store may not hold it): each request
ends, with a finish reason, within the server's token cap, as its log line says."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.test_serve import ServeProcess

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8080"
MODEL = "smollm2-135m-instruct"  # the store alias the README serves
# A request's log line: 'POST /v1/chat/completions 200 model: 37 prompt tokens (0 cached), 25 generated, ...,
# finish stop, ...'
LINE = re.compile(r"POST (/\S+) 200 \S+: \d+ prompt tokens \(\d+ cached\), (\d+) generated, .*, finish (\w+), ")


def section(name: str) -> str:
    text = README.read_text()
    start = text.index(f"\n{name}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def shell_commands() -> list[str]:
    """The commands of the "## Serve" section's shell block, continuation lines joined."""
    [block] = re.findall(r"```sh\n(.*?)```", section("## Serve"), flags=re.S)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def openai_snippets() -> list[str]:
    """The README's Python snippets that talk to the server through the `openai` client alone."""
    blocks = re.findall(r"```python\n(.*?)```", section("## Serve"), flags=re.S)
    others = ("from agents", "anthropic")  # snippets that need the Agents SDK, or the Images example's other clients
    return [b for b in blocks if "from openai import OpenAI" in b and not any(o in b for o in others)]


def test_the_readme_serves_then_asks_by_curl_and_by_openai():
    serve, curl = shell_commands()
    assert serve.startswith(f"base serve {MODEL} ") and curl.startswith(f"curl {README_URL}/v1/chat/completions")
    assert len(openai_snippets()) == 2  # streamed chat, then Responses


def served_lines(served: ServeProcess, count: int, timeout: float = 120.0) -> list[tuple[str, int, str]]:
    """(route, generated tokens, finish reason) of the first `count` request lines the server logged."""
    deadline = time.monotonic() + timeout
    while True:
        found = LINE.findall("".join(served.lines))
        if len(found) >= count or time.monotonic() > deadline:
            return [(route, int(n), reason) for route, n, reason in found]
        time.sleep(0.1)


@pytest.mark.slow
def test_every_readme_server_example_ends_within_the_cap(smollm2_gguf):
    serve, curl = shell_commands()
    args = shlex.split(serve)[3:]  # after `base serve MODEL`: the README's options, less its port
    port_at = args.index("--port")
    del args[port_at : port_at + 2]
    served = ServeProcess(smollm2_gguf, "--served-model-name", MODEL, *args, timeout=180)
    try:
        headers = {"Authorization": "Bearer sk-local"}
        cap = httpx.get(f"{served.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["max_tokens"]
        assert cap == 2048
        answer = subprocess.run(["bash", "-c", curl.replace(README_URL, served.url)], capture_output=True, timeout=600)
        done = json.loads(answer.stdout)
        assert done["choices"][0]["finish_reason"] in ("stop", "length")
        assert done["usage"]["completion_tokens"] <= cap
        num_requests = 1
        for snippet in openai_snippets():
            code = snippet.replace(README_URL, served.url)
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            assert result.stdout.strip()
            num_requests += snippet.count(".create(")
        lines = served_lines(served, num_requests)
        assert [route for route, _, _ in lines] == ["/v1/chat/completions"] * 2 + ["/v1/responses"] * 2
        assert all(n <= cap and reason in ("stop", "length") for _, n, reason in lines), lines
    finally:
        served.close()
