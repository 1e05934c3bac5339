"""Other projects' test suites against `base serve`: how well the OpenAI API holds up to real clients.

    python scripts/peer_suites.py [MODEL] [--suite NAME ...] [--json] [--keep DIR]

Suites (each runs under pytest in a subprocess; counts come from its JUnit report):

- `llamacpp-chat`, `llamacpp-tools`, `llamacpp-security`: llama.cpp's server tests
  (`tools/server/tests/unit/test_chat_completion.py`, `test_tool_call.py`, `test_security.py`),
  taken at run time from the `llama-cpp-python` sdist on PyPI (`pip download --no-binary`),
  never copied here; their `slow` tests (1-8B models from the hub) are left out. They run
  against the live server (`DEBUG_EXTERNAL=1`, `PORT`) through a plugin of ours
  (scripts/peer/llamacpp_plugin.py) that adds the /v1 prefix and the model name.
  The security suite gets a server with their API key and `--cors-origins localhost`.
- `langchain`: langchain-tests' standard `ChatModelIntegrationTests` with langchain-openai's
  `ChatOpenAI` (tests/api/test_langchain_standard.py, also run by `make test` on SmolLM2 served
  in the test process; here against this script's `base serve MODEL`).
- `litellm`: litellm's OpenAI-compatible provider: completion, stream, async, text completion,
  a forced tool call and its follow-up, a JSON Schema answer (tests/api/test_litellm.py, likewise).

MODEL defaults to SmolLM2-135M-Instruct (fetched once). Many failures with a 135M model are the
model answering wrongly, not the API; README.md ("Peer suites") lists what fails and why.
Needs the dev extra (langchain-openai, langchain-tests, litellm) and network access to PyPI for
the sdist (kept in $BASE_HOME/peer after the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

PEER = Path(__file__).resolve().parent / "peer"
CLIENT_TESTS = PEER.parents[1] / "tests" / "api"  # the real-client tests that `make test` runs too
LLAMACPP_TESTS = "vendor/llama.cpp/tools/server/tests"
SECURITY_KEY = "sk-this-is-the-secret-key"  # the key llama.cpp's security tests send
SUITES = {
    "llamacpp-chat": ("llamacpp", "unit/test_chat_completion.py"),
    "llamacpp-tools": ("llamacpp", "unit/test_tool_call.py"),
    "llamacpp-security": ("llamacpp", "unit/test_security.py"),
    "langchain": ("local", "test_langchain_standard.py"),
    "litellm": ("local", "test_litellm.py"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`base serve MODEL` on a free loopback port, until `stop`."""

    def __init__(self, model: str, name: str, *args: str, log: Path, max_model_len: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "baselm.cli", "serve", model, "--port", str(self.port)]
        command += ["--served-model-name", name, "--max-model-len", str(max_model_len), *args]
        self.log = log.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise SystemExit(f"base serve did not start; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def llamacpp_tests(cache: Path) -> Path:
    """llama.cpp's server tests, extracted once from the newest llama-cpp-python sdist."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llama_cpp_python-*/" + LLAMACPP_TESTS))
    if found:
        return found[-1]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "llama-cpp-python"],
        cwd=cache,
        check=True,
    )
    [sdist] = sorted(cache.glob("llama_cpp_python-*.tar.gz"))[-1:]
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if f"/{LLAMACPP_TESTS}/" in m.name]
        tar.extractall(cache, members=members, filter="data")
    return sorted(cache.glob("llama_cpp_python-*/" + LLAMACPP_TESTS))[-1]


def run_pytest(target: str, cwd: Path, env: dict[str, str], report: Path, plugin: bool) -> dict:
    """Runs one test file; returns its counts and the failures' names and first lines."""
    command = [sys.executable, "-m", "pytest", "-q", target, f"--junitxml={report}", "-p", "no:cacheprovider"]
    if plugin:  # llama.cpp's `slow` tests download and run 1-8B models from the hub: not for this model
        command += ["-p", "llamacpp_plugin", "-m", "not slow"]
    else:  # langchain-tests' async tests run under pytest-asyncio
        command += ["-o", "asyncio_mode=auto", "-o", "asyncio_default_test_loop_scope=session"]
        command += ["-o", "asyncio_default_fixture_loop_scope=session"]  # one loop: the model's clients outlive a test
    subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    return read_report(report)


def read_report(report: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            failures[case.get("name", "?")] = message[0][:200] if message else ""
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def run_suite(name: str, model: str, work: Path, cache: Path) -> dict:
    kind, target = SUITES[name]
    served_name = "smollm2"
    args: list[str] = []
    if name == "llamacpp-security":
        args = ["--api-key", SECURITY_KEY, "--cors-origins", "localhost"]
    # llama.cpp's tests leave max_tokens unset where their server stops at 64 tokens or a small
    # context: a 1024-token context keeps those answers short (and long prompts over it).
    max_model_len = 1024 if kind == "llamacpp" else 4096
    served = Served(model, served_name, *args, log=work / f"{name}.serve.log", max_model_len=max_model_len)
    try:
        env = {**os.environ, "BASE_PEER_MODEL": served_name, "BASE_PEER_URL": served.url}
        env.pop("BASE_API_KEY", None)
        if kind == "llamacpp":
            tests = llamacpp_tests(cache)
            env.update(DEBUG_EXTERNAL="1", PORT=str(served.port), PYTHONPATH=str(PEER))
            return run_pytest(target, tests, env, work / f"{name}.xml", plugin=True)
        return run_pytest(str(CLIENT_TESTS / target), work, env, work / f"{name}.xml", plugin=False)
    finally:
        served.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="Run only these (repeatable).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object, failures included.")
    parser.add_argument("--keep", type=Path, help="Keep reports and server logs in this folder.")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from baselm.store.default_model import fetch_default_gguf

        model = str(fetch_default_gguf())
    home = Path(os.environ.get("BASE_HOME", Path.home() / ".cache" / "base"))
    work = args.keep or Path(tempfile.mkdtemp(prefix="base-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.suite or list(SUITES):
        results[name] = run_suite(name, model, work, home / "peer")
        if not args.json:
            r = results[name]
            print(f"{name:18} {r['passed']:3} passed {r['failed']:3} failed {r['skipped']:3} skipped", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"reports and server logs: {work}")


if __name__ == "__main__":
    main()
