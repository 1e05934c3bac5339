"""`base ps` as a person runs it: against a real `base serve` on loopback, and where none answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.api.test_serve import ServeProcess, _free_port
from tests.tiny_model import write_model_folder


def base(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "baselm.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`base serve` of the tiny model, with an API key."""
    server = ServeProcess(
        write_model_folder(tmp_path_factory.mktemp("ps")), "--api-key", "sk-ps", "--served-model-name", "tiny"
    )
    yield server
    server.close()


def test_ps_lists_the_served_model(served):
    env = {**os.environ, "BASE_API_KEY": "sk-ps"}
    result = base("ps", "--port", str(served.port), env=env)
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == ["name", "size", "processor", "context", "quant", "format"]
    assert row.split()[0] == "tiny" and " CPU " in row and " 2048 " in row
    answer = json.loads(base("ps", "--port", str(served.port), "--json", "--api-key", "sk-ps").stdout)
    assert [m["name"] for m in answer["models"]] == ["tiny"]


def test_ps_without_the_key_says_the_server_wants_one(served):
    env = {k: v for k, v in os.environ.items() if k != "BASE_API_KEY"}
    result = base("ps", "--port", str(served.port), env=env)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: the server at http://127.0.0.1:{served.port} wants an API key: give --api-key KEY or set BASE_API_KEY"
    )


def test_ps_with_no_server_is_one_line():
    result = base("ps", "--port", str(_free_port()))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no server answers at http://127.0.0.1:" in result.stderr and "base serve MODEL" in result.stderr
