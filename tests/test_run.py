"""`base run`: an engine sized for its one request, only the libraries the run needs imported, and a hub
model not in the store pulled after a yes (or with --pull)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from baselm.commands.run import one_request_config
from tests.paths import FIXTURES

BASE = shutil.which("base") or str(Path(sys.executable).parent / "base")


def test_kv_pool_holds_the_prompt_and_max_tokens_in_whole_blocks():
    config = one_request_config(num_prompt_tokens=33, max_tokens=16)
    assert config.max_num_seqs == 1
    assert config.max_model_len == 64  # 49 tokens round up to 4 blocks of 16


def test_no_max_tokens_keeps_the_models_context():
    assert one_request_config(num_prompt_tokens=10, max_tokens=None).max_model_len is None


def test_the_run_command_leaves_signature_and_gguf_libraries_unimported():
    # cryptography (~9 MiB) is for signed loads, the gguf package (with yaml) for GGUF files.
    code = (
        "import sys, baselm.commands.run, baselm.loader, baselm.store.registry; "
        "print(sorted(m for m in ('cryptography', 'gguf', 'baselm.store.gguf') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_reranker_with_a_classification_head_is_refused_as_writing_no_text(tmp_path):
    command = [BASE, "run", str(FIXTURES / "rerankers" / "qwen3"), "hi", "--device", "cpu"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "BASE_HOME": str(tmp_path)}
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: qwen3 is a reranker with a classification head: it ranks documents (POST /v1/rerank on "
        "`base serve`) and writes no text"
    )


# ---------------------------------------------------------------------------------------------
# A hub model not in the store, through the real `base run` against a local hub


@pytest.fixture
def hub_env(tmp_path):
    from tests.paths import LLAMA_FIXTURE
    from tests.store.hub_server import HubServer, tiny_llama_files

    with HubServer() as hub:
        hub.add_repo("org/Tiny-Llama", tiny_llama_files(LLAMA_FIXTURE))
        yield {**os.environ, "BASE_HOME": str(tmp_path / "home"), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_none"}


def _run(*args: str, env: dict) -> subprocess.CompletedProcess:
    command = [BASE, "run", "org/Tiny-Llama", *args, "--device", "cpu"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_a_hub_model_not_stored_says_how_to_pull_it_when_nobody_can_answer(hub_env):
    result = _run("t1 t2", "-n", "2", env=hub_env)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: org/Tiny-Llama is not in the store (base list shows what is); pull it with "
        "`base pull org/Tiny-Llama`, or run again with --pull"
    )


def test_pull_brings_a_hub_model_then_answers(hub_env):
    result = _run("t1 t2", "-n", "2", "--pull", env=hub_env)
    assert result.returncode == 0, result.stderr
    assert "pulled org/Tiny-Llama:q4" in result.stderr and "2 generated" in result.stderr


def test_on_a_terminal_base_run_asks_before_pulling(hub_env):
    child = pexpect.spawn(BASE, ["run", "org/Tiny-Llama", "t1", "-n", "2", "--device", "cpu"], env=hub_env, timeout=120)
    child.expect_exact("org/Tiny-Llama is not in the store. Pull it from the Hugging Face hub? [y/N] ")
    child.sendline("n")
    child.expect_exact("pull it with `base pull org/Tiny-Llama`")
    child.expect(pexpect.EOF)
    child = pexpect.spawn(BASE, ["run", "org/Tiny-Llama", "t1", "-n", "2", "--device", "cpu"], env=hub_env, timeout=120)
    child.expect_exact("[y/N] ")
    child.sendline("y")
    child.expect_exact("pulled org/Tiny-Llama:q4")
    child.expect_exact("2 generated")
    child.expect(pexpect.EOF)


def test_a_missing_file_is_not_taken_for_a_hub_model(hub_env):
    command = [BASE, "run", "models/tiny.gguf", "hi", "--pull", "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=hub_env)
    assert result.returncode == 1 and "pulled" not in result.stderr
    assert result.stderr.startswith("error: no stored model named 'models/tiny.gguf'")
