"""`base run`: an engine sized for its one request, and only the libraries the run needs imported."""

from __future__ import annotations

import subprocess
import sys

from baselm.commands.run import one_request_config


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
