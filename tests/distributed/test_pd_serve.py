"""`base serve --pd 1:1` as processes: the same answer as one process (rank 0 alone, after the
decode process died mid-request with a 503 stream error), a clean exit on SIGTERM, and ranks
joined from a hostfile that check their role."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.api.test_serve import ServeProcess
from tests.tiny_model import write_model_folder

BODY = {"model": "m", "prompt": "Hello there, how are you", "max_tokens": 12, "temperature": 0}
LONG = " ".join(f"word{i % 37}" for i in range(120))  # a prompt of several full KV blocks


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("tiny-chatml"), eos=False)


def complete(served: ServeProcess, **changes) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/completions", json={**BODY, **changes}, timeout=60)


def embedding(served: ServeProcess) -> list[float]:
    answer = httpx.post(f"{served.url}/v1/embeddings", json={"model": "m", "input": "hello"}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["data"][0]["embedding"]


def started_ranks(served: ServeProcess) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(served.proc.pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def test_pd_server_answers_like_one_process_then_503_on_a_dead_rank_then_serves_alone(model_folder):
    served = ServeProcess(model_folder, "--served-model-name", "m", "--kv-memory", "8MiB", "--pd", "1:1")
    try:
        first = complete(served)
        assert first.status_code == 200
        vector = embedding(served)  # computed on rank 0's prefill model and pool
        (decode_rank,) = started_ranks(served)
        with httpx.stream(
            "POST", f"{served.url}/v1/completions", json={**BODY, "max_tokens": 400, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # decoding on rank 1 now
            subprocess.run(["kill", "-9", str(decode_rank)], check=True)
            rest = "\n".join(lines)
        assert "a process of the prefill/decode group failed" in rest
        alone = complete(served)  # rank 0 serves in one process now: the answer one process gives
        assert alone.status_code == 200 and alone.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert embedding(served) == vector
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0
    finally:
        served.close()


def test_ranks_joined_from_a_hostfile_check_their_role_and_fail_without_hanging(model_folder, tmp_path, request):
    from baselm.distributed.group import reserve_ports

    reserved = reserve_ports(2)  # held for the hostfile's ranks until the test ends
    request.addfinalizer(reserved.release)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in reserved.ports]))
    base = [sys.executable, "-m", "baselm.cli", "serve", str(model_folder), "--pd", "1:1", "--hostfile", str(hostfile)]
    base += ["--prefix-cache-file", str(tmp_path / "p")]  # taken beside a hostfile with --pd (refused for TP)
    ranks = [
        subprocess.Popen([*base, "--rank", str(rank), "--role", "prefill", "--port", str(port)], stderr=subprocess.PIPE)
        for rank, port in ((0, 0), (1, 0))  # neither rank gets as far as serving HTTP
    ]
    errors = [rank.communicate(timeout=120)[1].decode() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [1, 1]
    assert "rank 1 is a decode rank under --pd 1:1" in " ".join(errors[1].split())
    assert "rank of the group is gone" in " ".join(errors[0].split())  # rank 0 is told, it does not hang


def test_pd_server_answers_schemas_forced_calls_copies_and_prompt_logprobs_as_one_process(tmp_path):
    """The requests a single engine serves and --pd once refused, through the HTTP API, against the
    same model served by one process; /metrics shows what the handoffs shipped."""
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from tests.api.conftest import RunningServer
    from tests.api.test_structured import ASK
    from tests.structured.schemas import PERSON, TIME, WEATHER

    folder = write_model_folder(tmp_path / "tiny-eos")  # with end-of-sequence ids: a grammar's answer ends
    served = ServeProcess(folder, "--served-model-name", "m", "--kv-memory", "8MiB", "--pd", "1:1")
    alone = RunningServer(loaded=load_model(str(folder), select_backend("cpu")), model_name="m", kv_memory=8 * 2**20)
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chats = [
        {"response_format": person, "max_tokens": 80},
        {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120},
        {"n": 2, "seed": 4, "temperature": 1.0, "max_tokens": 12, "logprobs": True, "top_logprobs": 2},
    ]
    echo = {**BODY, "prompt": "Score every token of this", "echo": True, "logprobs": 2, "max_tokens": 3}
    try:
        answers, alone_answers = [], []
        for changes in chats:
            body = {"model": "m", "messages": ASK, "temperature": 0, **changes}
            pd, one = (httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120) for s in (served, alone))
            assert (pd.status_code, one.status_code) == (200, 200), pd.text
            pd, one = pd.json()["choices"], one.json()["choices"]
            assert [_choice(c) for c in pd] == [_choice(c) for c in one] and len(pd) == body.get("n", 1)
            answers.append(pd)
            alone_answers.append(one)
        json.loads(answers[0][0]["message"]["content"])  # the schema's object
        assert answers[1][0]["finish_reason"] == "tool_calls"
        assert answers[2][0]["message"]["content"] != answers[2][1]["message"]["content"]  # a seed each
        assert np.allclose(_logprobs(answers[2]), _logprobs(alone_answers[2]), atol=1e-4)
        pd, one = (httpx.post(f"{s.url}/v1/completions", json=echo, timeout=120) for s in (served, alone))
        pd, one = pd.json()["choices"][0]["logprobs"], one.json()["choices"][0]["logprobs"]
        assert pd["tokens"] == one["tokens"] and pd["token_logprobs"][0] is None
        assert np.allclose(pd["token_logprobs"][1:], one["token_logprobs"][1:], atol=1e-4)
        metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
        shipped = _metric(metrics, "base_pd_kv_blocks_shipped_total")
        assert shipped > 0 and _metric(metrics, "base_pd_kv_bytes_shipped_total") % shipped == 0
        assert "base_pd_kv_blocks_skipped_total{" in metrics
        assert "base_pd_" not in httpx.get(f"{alone.url}/metrics", timeout=30).text
    finally:
        served.close()
        alone.stop()


def test_pd_server_restarted_on_its_prefix_cache_file_serves_a_repeated_prompt_from_it(model_folder, tmp_path):
    """`--prefix-cache-file F` with --pd: the prefill rank saves F.prefill0 as the server stops; a new
    group loads it and serves the same prompt from it, with one process's answer."""
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from tests.api.conftest import RunningServer

    args = (
        "--served-model-name",
        "m",
        "--kv-memory",
        "8MiB",
        "--pd",
        "1:1",
        "--prefix-cache-file",
        str(tmp_path / "p"),
    )
    answers = []
    for _ in range(2):
        served = ServeProcess(model_folder, *args)
        try:
            answers.append(complete(served, prompt=LONG).json())
            metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
            served.proc.send_signal(signal.SIGTERM)  # the prefill rank saves as the group stops
            assert served.proc.wait(60) == 0
        finally:
            served.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p.prefill0"]
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    assert cached[0] == 0 and cached[1] >= 112  # the prompt's full blocks, served from the file
    assert _metric(metrics, "base_prefix_cache_hits_total") == cached[1]
    alone = RunningServer(loaded=load_model(str(model_folder), select_backend("cpu")), model_name="m")
    try:
        one = httpx.post(f"{alone.url}/v1/completions", json={**BODY, "prompt": LONG}, timeout=60).json()
    finally:
        alone.stop()
    assert [a["choices"][0]["text"] for a in answers] == [one["choices"][0]["text"]] * 2


def test_pd_server_saves_its_prefix_cache_file_at_the_save_interval_while_it_serves(model_folder, tmp_path):
    file = tmp_path / "p.prefill0"
    args = ("--served-model-name", "m", "--pd", "1:1", "--prefix-cache-file", str(tmp_path / "p"))
    served = ServeProcess(model_folder, *args, "--prefix-cache-save-interval", "0.2")
    try:
        assert complete(served, prompt=LONG).status_code == 200  # full blocks: the cache changed
        deadline = time.monotonic() + 60
        while not file.exists():  # written by the prefill rank when the interval comes due, not at shutdown
            assert time.monotonic() < deadline, "no prefix cache file while the server runs"
            time.sleep(0.1)
        assert served.proc.poll() is None and complete(served).status_code == 200
    finally:
        served.close()


def _choice(choice: dict) -> dict:
    """What a chat choice says: its text, its calls (without their ids, new each answer), tokens and finish."""
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    tokens = [t["token"] for t in (choice["logprobs"] or {}).get("content") or []]
    return {"content": message.get("content"), "calls": calls, "tokens": tokens, "finish": choice["finish_reason"]}


def _logprobs(choices: list[dict]) -> list[float]:
    return [t["logprob"] for c in choices for t in c["logprobs"]["content"]]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
