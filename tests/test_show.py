"""`base show` and `base inspect` as a person runs them: a model pulled into a store of its own,
then looked at through the real `base` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_gguf import tiny_llama_gguf
from tests.tiny_model import write_model_folder


def base(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "baselm.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """A store holding the tiny llama as a Q4_1 GGUF (org/tiny-gguf) and as an HF folder (org/tiny-hf)."""
    tmp = tmp_path_factory.mktemp("show")
    env = {**os.environ, "BASE_HOME": str(tmp / "home")}
    gguf_path, _ = tiny_llama_gguf(tmp / "tiny.gguf", "Q4_1")
    for source, name in ((gguf_path, "org/tiny-gguf"), (write_model_folder(tmp / "hf"), "org/tiny-hf")):
        pulled = base("pull", str(source), "--name", name, "--quiet", env=env)
        assert pulled.returncode == 0, pulled.stderr
    return env


def test_show_prints_the_models_shape_quantization_and_template(store):
    result = base("show", "org/tiny-hf", env=store)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    for row in ("architecture        llama", "context length      2048", "layers              2"):
        assert row in lines
    assert "origin              quantized by base (profile default-q4) from the safetensors weights" in lines
    assert "base_q4             14 tensors, 49.2K weights" in lines
    assert "Chat template  (--template prints it whole)" in lines
    assert "{%- if tools %}" in lines and any(line.startswith("... ") for line in lines)


def test_show_says_a_ggufs_blocks_were_kept(store):
    lines = [line.strip() for line in base("show", "org/tiny-gguf", env=store).stdout.splitlines()]
    assert "origin              kept from the GGUF's own Q4_1 blocks, exactly" in lines
    assert "parameters          82.2K" in lines and "none" in lines  # no chat template


def test_show_json_and_template(store):
    card = json.loads(base("show", "org/tiny-hf", "--json", env=store).stdout)
    assert card["architecture"]["context_length"] == card["context_length"] == 2048
    assert card["quantization"]["by_dtype"]["base_q4"]["tensors"] == 14
    template = base("show", "org/tiny-hf", "--template", env=store).stdout
    assert template == card["chat_template"] + "\n"
    refused = base("show", "org/tiny-gguf", "--template", env=store)
    assert refused.returncode == 1 and "has no chat template" in refused.stderr


def test_show_of_a_file_not_stored_says_how_to_store_it(store, tmp_path):
    result = base("show", str(write_model_folder(tmp_path / "hf")), env=store)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is a folder; base show reads stored models: `base pull" in result.stderr


def test_inspect_lists_layers_in_order_with_the_context_length(store):
    result = base("inspect", "org/tiny-hf", env=store)
    assert result.returncode == 0, result.stderr
    assert "context length: 2048 tokens" in result.stdout
    layers = [line.split(".")[2] for line in result.stdout.splitlines() if "model.layers." in line]
    assert layers == sorted(layers, key=int) and layers[0] == "0"


def test_show_names_the_source_of_the_name_asked_for_when_one_file_has_two(store, tmp_path):
    from tests.tiny_gguf import tiny_llama_gguf

    copy, _ = tiny_llama_gguf(tmp_path / "again.Q4_1.gguf", "Q4_1")  # the same bytes as org/tiny-gguf's
    assert base("pull", str(copy), "--name", "org/again", "--quiet", env=store).returncode == 0
    cards = {
        name: json.loads(base("show", name, "--json", env=store).stdout) for name in ("org/tiny-gguf", "org/again")
    }
    assert cards["org/tiny-gguf"]["path"] == cards["org/again"]["path"]  # one file
    assert cards["org/again"]["source"]["path"] == str(copy)
    assert cards["org/tiny-gguf"]["source"]["path"] != str(copy)
    assert cards["org/again"]["source"]["tensors"] == cards["org/tiny-gguf"]["source"]["tensors"]
