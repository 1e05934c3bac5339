"""`base serve --pd 1:1` as processes: the same answer as one process (rank 0 alone, after the
decode process died mid-request with a 503 stream error), a clean exit on SIGTERM, and ranks
joined from a hostfile that check their role."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.test_serve import ServeProcess
from tests.tiny_model import write_model_folder

BODY = {"model": "m", "prompt": "Hello there, how are you", "max_tokens": 12, "temperature": 0}


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


def test_ranks_joined_from_a_hostfile_check_their_role_and_fail_without_hanging(model_folder, tmp_path):
    from tests.dist.pd_group import free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    base = [sys.executable, "-m", "baselm.cli", "serve", str(model_folder), "--pd", "1:1", "--hostfile", str(hostfile)]
    ranks = [
        subprocess.Popen([*base, "--rank", str(rank), "--role", "prefill", "--port", str(port)], stderr=subprocess.PIPE)
        for rank, port in ((0, free_ports(1)[0]), (1, 0))
    ]
    errors = [rank.communicate(timeout=120)[1].decode() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [1, 1]
    assert "rank 1 is a decode rank under --pd 1:1" in " ".join(errors[1].split())
    assert "rank of the group is gone" in " ".join(errors[0].split())  # rank 0 is told, it does not hang
