"""Other projects' test suites against `base serve`: how well the OpenAI API holds up to real clients.

    python tests/tools/peer_suites.py [MODEL] [--suite NAME ...] [--sglang DIR] [--pd P:D] [--limit S]
                                      [--json] [--keep DIR]

Suites (each runs under pytest in a subprocess; counts come from its JUnit report):

- `llamacpp-chat`, `llamacpp-tools`, `llamacpp-security`: llama.cpp's server tests
  (`tools/server/tests/unit/test_chat_completion.py`, `test_tool_call.py`, `test_security.py`),
  taken at run time from the `llama-cpp-python` sdist on PyPI (`pip download --no-binary`),
  never copied here; their `slow` tests (1-8B models from the hub) are left out. They run
  against the live server (`DEBUG_EXTERNAL=1`, `PORT`) through a plugin of ours
  (tests/tools/peer/llamacpp_plugin.py) that adds the /v1 prefix and the model name.
  The security suite gets a server with their API key and `--cors-origins localhost`.
- `langchain`: langchain-tests' standard `ChatModelIntegrationTests` with langchain-openai's
  `ChatOpenAI` (tests/api/test_langchain_standard.py, also run by `make test` on SmolLM2 served
  in the test process; here against this script's `base serve MODEL`).
- `litellm`: litellm's OpenAI-compatible provider: completion, stream, async, text completion,
  a forced tool call and its follow-up, a JSON Schema answer (tests/api/test_litellm.py, likewise).
- `sglang-server`, `sglang-tools`: SGLang's `test/srt/openai_server/basic/test_openai_server.py`
  and `function_call/test_tool_choice.py`, run from a checkout of SGLang given as `--sglang DIR`
  (SGLang is not on PyPI; nothing of it is copied here). A plugin of ours
  (tests/tools/peer/sglang_plugin.py) stands in for the `sglang` imports; the server gets their key.

Each suite's failures are sorted by tests/tools/peer/triage.py into not applicable (another server's
endpoints, fields and launch flags) and model-limited (a 135M model answering wrongly, in a
well-formed response); what is left is counted as failed and printed. A suite still running after
`--limit` seconds is stopped and counted by the tests it finished.

`--pd P:D` serves with `base serve MODEL --pd P:D` (P prefill and D decode processes behind the
one server) instead of one process; everything else (seed, context, keys) stays the same, so the
counts of the two compare suite by suite.

MODEL defaults to SmolLM2-135M-Instruct (fetched once). docs/testing.md ("Peer suites") lists what
fails and why.
Needs the dev extra (langchain-openai, langchain-tests, litellm) and network access to PyPI for
the sdist (kept in $BASE_HOME/peer after the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
sys.path.insert(0, str(PEER))
from triage import MODEL_LIMITED, NOT_APPLICABLE, classify  # noqa: E402  (tests/tools/peer/triage.py)

CLIENT_TESTS = PEER.parents[2] / "tests" / "api"  # the real-client tests that `make test` runs too
LLAMACPP_TESTS = "vendor/llama.cpp/tools/server/tests"
SECURITY_KEY = "sk-this-is-the-secret-key"  # the key llama.cpp's security tests send
SGLANG_KEY = "sk-123456"  # the key SGLang's tests send
SUITES = {
    "llamacpp-chat": ("llamacpp", "unit/test_chat_completion.py"),
    "llamacpp-tools": ("llamacpp", "unit/test_tool_call.py"),
    "llamacpp-security": ("llamacpp", "unit/test_security.py"),
    "langchain": ("local", "test_langchain_standard.py"),
    "litellm": ("local", "test_litellm.py"),
    "sglang-server": ("sglang", "test/srt/openai_server/basic/test_openai_server.py"),
    "sglang-tools": ("sglang", "test/srt/openai_server/function_call/test_tool_choice.py"),
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
        command += ["--seed", "0"]  # their requests sample without a seed: the same answers every run
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


def run_pytest(target: str, cwd: Path, env: dict[str, str], report: Path, plugin: str | None, limit_s: float) -> bool:
    """Runs one test file under pytest, its JUnit report written to `report`; False when stopped at `limit_s`."""
    command = [sys.executable, "-m", "pytest", "-q", target, f"--junitxml={report}", "-p", "no:cacheprovider"]
    if plugin == "llamacpp_plugin":  # their `slow` tests download and run 1-8B models from the hub: not for this model
        command += ["-p", plugin, "-m", "not slow"]
    elif plugin is not None:
        command += ["-p", plugin]
    else:  # langchain-tests' async tests run under pytest-asyncio
        command += ["-o", "asyncio_mode=auto", "-o", "asyncio_default_test_loop_scope=session"]
        command += ["-o", "asyncio_default_fixture_loop_scope=session"]  # one loop: the model's clients outlive a test
    run = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run.wait(limit_s)
        return True
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGINT)  # pytest stops and still writes the report of the tests it finished
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
        return False


def read_report(suite: str, report: Path) -> dict:
    """Counts from a JUnit report; failures sorted into not applicable, model-limited and failed."""
    counts = {"passed": 0, "failed": 0, NOT_APPLICABLE: 0, MODEL_LIMITED: 0, "skipped": 0}
    failures: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is None:
            counts["skipped" if case.find("skipped") is not None else "passed"] += 1
            continue
        name = case.get("name", "?")
        test_class = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{test_class}::{name}" if test_class.startswith("Test") else name  # unittest classes
        message = (problem.get("message") or problem.text or "").strip().splitlines()
        category, reason = classify(suite, name) or ("failed", message[0][:200] if message else "")
        counts[category] += 1
        failures[name] = {"category": category, "reason": reason}
    return {**counts, "failures": failures}


def run_suite(
    name: str, model: str, work: Path, cache: Path, sglang: Path | None, limit_s: float, pd: str | None = None
) -> dict:
    kind, target = SUITES[name]
    served_name = "smollm2"
    args: list[str] = ["--pd", pd] if pd else []
    if name == "llamacpp-security":
        args += ["--api-key", SECURITY_KEY, "--cors-origins", "localhost"]
    elif kind == "sglang":
        args += ["--api-key", SGLANG_KEY]
    # llama.cpp's tests leave max_tokens unset where their server stops at 64 tokens or a small
    # context: a 1024-token context keeps those answers short (and long prompts over it).
    max_model_len = 1024 if kind == "llamacpp" else 4096
    served = Served(model, served_name, *args, log=work / f"{name}.serve.log", max_model_len=max_model_len)
    report = work / f"{name}.xml"
    try:
        env = {**os.environ, "BASE_PEER_MODEL": served_name, "BASE_PEER_URL": served.url, "PYTHONPATH": str(PEER)}
        env.pop("BASE_API_KEY", None)
        if kind == "llamacpp":
            env.update(DEBUG_EXTERNAL="1", PORT=str(served.port))
            finished = run_pytest(target, llamacpp_tests(cache), env, report, "llamacpp_plugin", limit_s)
        elif kind == "sglang":
            env.update(BASE_PEER_KEY=SGLANG_KEY)
            finished = run_pytest(target, sglang, env, report, "sglang_plugin", limit_s)
        else:
            finished = run_pytest(str(CLIENT_TESTS / target), work, env, report, None, limit_s)
    finally:
        served.stop()
    return {**read_report(name, report), "finished": finished}


def summary(name: str, result: dict) -> str:
    counts = [f"{result[k]:3} {k}" for k in ("passed", "failed", NOT_APPLICABLE, MODEL_LIMITED, "skipped")]
    return f"{name:18} " + ", ".join(counts) + ("" if result["finished"] else " (stopped at --limit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="Run only these (repeatable).")
    parser.add_argument("--sglang", type=Path, help="A checkout of SGLang, for the sglang-* suites.")
    parser.add_argument("--pd", metavar="P:D", help="Serve with --pd P:D (prefill and decode processes), e.g. 1:1.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object, failures included.")
    parser.add_argument("--limit", type=float, default=3600, help="Seconds a suite may run (default 3600).")
    parser.add_argument("--keep", type=Path, help="Keep reports and server logs in this folder.")
    args = parser.parse_args()
    names = args.suite or [n for n in SUITES if args.sglang or SUITES[n][0] != "sglang"]
    if args.sglang is None and any(SUITES[n][0] == "sglang" for n in names):
        parser.error("the sglang-* suites need --sglang DIR, a checkout of SGLang")
    model = args.model
    if model is None:
        from baselm.store.default_model import fetch_default_gguf

        model = str(fetch_default_gguf())
    home = Path(os.environ.get("BASE_HOME", Path.home() / ".cache" / "base"))
    work = args.keep or Path(tempfile.mkdtemp(prefix="base-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        results[name] = run_suite(name, model, work, home / "peer", args.sglang, args.limit, args.pd)
        if not args.json:
            print(summary(name, results[name]), flush=True)
            for test, failure in results[name]["failures"].items():
                if failure["category"] == "failed":
                    print(f"    failed: {test}: {failure['reason']}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"reports and server logs: {work}")
    if any(result["failed"] or not result["finished"] for result in results.values()):
        sys.exit(1)  # a failure no triage explains (a defect), or a suite that did not finish


if __name__ == "__main__":
    main()
