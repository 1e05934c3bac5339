"""`base doctor MODEL` through the real `base` entry point: each GGUF tensor type's fate (kept as
blocks, run so here or converted, kept exactly, re-quantized, floats, refused) and the tokenizer's,
before anything is pulled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from baselm.backend import select_backend
from baselm.commands.doctor_model import gguf_type_action
from baselm.loader import kept_block_types
from tests.tiny_gguf import add_llama_hparams, random_blocks, tiny_llama_gguf, write_gguf
from tests.tiny_model import write_model_folder
from tests.vision_fixture import IDEFICS3
from tests.vision_gguf import write_vision_gguf


def doctor(*args: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "BASE_HOME": str(home)}
    command = [sys.executable, "-m", "baselm.cli", "doctor", *args, "--no-speed"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_a_gguf_whose_blocks_base_keeps_is_reported_runnable(tmp_path):
    path, _ = tiny_llama_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    result = doctor(str(path), home=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    action = gguf_type_action("Q4_1", kept_block_types(select_backend("auto")))  # as this machine runs them
    assert any(line.startswith("Q4_1") and line.endswith(action) for line in lines), lines
    assert any(line.startswith("F32") and line.endswith("kept as f32") for line in lines)
    assert "base can run it" in lines
    report = json.loads(doctor(str(path), "--json", home=tmp_path).stdout)["model"]
    assert report["format"] == "gguf" and report["model_type"] == "llama"
    assert report["tokenizer"]["status"] == "read" and "refused" not in report


def test_types_base_requantizes_or_cannot_read_and_a_refused_tokenizer_are_named(tmp_path):
    tensors = {
        "blk.0.ffn_down.weight": (random_blocks("Q6_K", 4, 256), "Q6_K"),
        "blk.0.ffn_up.weight": (np.zeros((4, 66), dtype=np.uint8), "IQ2_XXS"),
    }

    def metadata(writer) -> None:
        add_llama_hparams(writer, {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 4,
                                   "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                                   "max_position_embeddings": 64, "rope_parameters": {"rope_theta": 1e4}})  # fmt: skip
        writer.add_tokenizer_model("no-such-model")
        writer.add_token_list(["a", "b"])

    path = write_gguf(tmp_path / "odd.gguf", tensors, metadata)
    report = json.loads(doctor(str(path), "--json", home=tmp_path).stdout)["model"]
    actions = {row["type"]: row["action"] for row in report["tensors"]}
    assert actions["Q6_K"] == gguf_type_action("Q6_K", kept_block_types(select_backend("auto")))
    assert actions["Q6_K"].startswith("kept as its blocks (gguf_q6_k)") and "base_q8 re-quantized" in actions["Q6_K"]
    assert actions["IQ2_XXS"].startswith("refused")
    assert gguf_type_action("Q2_K") == (
        "kept as its blocks (gguf_q2_k); runs here (and where no block kernel runs) as base_q4 re-quantized"
    )
    assert gguf_type_action("IQ4_XS", frozenset({"IQ4_XS"})) == (
        "kept as its blocks (gguf_iq4_xs), which the CPU kernels run here; base_q8 exactly where no block kernel runs"
    )
    assert report["tokenizer"]["status"].startswith("refused: ")
    assert "IQ2_XXS" in report["refused"]  # the file as a whole: the type base cannot read
    text = doctor(str(path), home=tmp_path).stdout
    assert "refused:" in text and "base can run it" not in text


def test_a_folder_and_a_name_that_is_nothing(tmp_path):
    report = json.loads(doctor(str(write_model_folder(tmp_path / "hf")), "--json", home=tmp_path).stdout)["model"]
    assert report["format"] == "safetensors" and report["action"].startswith("quantized at pull")
    missing = doctor("no/such-model", home=tmp_path)
    assert missing.returncode == 1 and "no stored model named 'no/such-model'" in missing.stderr


def test_a_gguf_says_whether_it_takes_images_through_the_projector_beside_it(tmp_path):
    folder = tmp_path / "smolvlm"
    folder.mkdir()
    model, _ = write_vision_gguf(folder, IDEFICS3)
    alone = json.loads(doctor(str(model), "--json", home=tmp_path).stdout)["model"]
    assert alone["images"].startswith("no: a GGUF alone reads text; a vision projector")
    report = json.loads(doctor(str(folder), "--json", home=tmp_path).stdout)["model"]
    assert (report["format"], report["model_type"]) == ("gguf", "llama")
    assert report["images"] == "yes, through the vision projector mmproj-idefics3_vlm-F32.gguf (idefics3)"
    assert "  base can run it" in doctor(str(folder), home=tmp_path).stdout.splitlines()


def test_a_projector_base_cannot_read_is_named_with_what_to_do(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    tiny_llama_gguf(folder / "tiny.Q8_0.gguf", "Q8_0")

    def metadata(writer) -> None:
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type("pixtral")

    write_gguf(folder / "mmproj-tiny-F16.gguf", {}, metadata, arch="clip")
    lines = [line.strip() for line in doctor(str(folder), home=tmp_path).stdout.splitlines()]
    assert "images: refused: mmproj-tiny-F16.gguf: projector type 'pixtral' is not supported" in " ".join(lines)
    assert "base cannot run it with its vision projector (base pull --no-mmproj stores the text model alone)" in lines


def test_a_block_type_s_action_says_whether_this_machine_runs_its_blocks() -> None:
    assert gguf_type_action("Q5_0", frozenset({"Q5_0"})) == (
        "kept as its blocks (gguf_q5_0), which the CPU kernels run here; base_q5 exactly where no block kernel runs"
    )
    assert gguf_type_action("Q8_0", frozenset({"Q5_0"})) == (
        "kept as its blocks (gguf_q8_0); runs here (and where no block kernel runs) as base_q8 exactly"
    )
    assert gguf_type_action("Q3_K", frozenset({"Q5_0"})) == (
        "kept as its blocks (gguf_q3_k); runs here (and where no block kernel runs) as base_q8 exactly"
    )
