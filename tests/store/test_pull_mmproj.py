"""`base pull` of a hub GGUF repo that ships vision projectors (`mmproj*.gguf`), against a local
server speaking the hub's file API: the projector llama.cpp's `-hf` takes comes with the model into
one `.base` file that reads images as the local GGUF + mmproj pair does; `--mmproj` takes another,
`--no-mmproj` none; a projector base cannot read is refused by name, or left out with a note when
it was only the default pick; and it downloads as every hub file does (resumed, verified).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hub_server import HubServer

from baselm.backend import select_backend
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.models import supported_model_types
from baselm.sampling.params import SamplingParams
from baselm.store.base_reader import BaseFile
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.hub import DEFAULT_MMPROJ, HubClient, MmprojChoice, NoProgress
from baselm.store.model_card import model_card
from baselm.store.pull import pull
from baselm.store.registry import Store
from tests.tiny_gguf import tiny_llama_gguf, write_gguf
from tests.vision_fixture import IDEFICS3, prompt_logits
from tests.vision_gguf import write_mmproj, write_vision_gguf

VLM = "org/SmolVLM-GGUF"  # the SmolVLM fixture as llama.cpp's converter writes it, with two projectors
MODEL, F16, F32 = "idefics3_vlm-F32.gguf", "mmproj-idefics3_vlm-F16.gguf", "mmproj-idefics3_vlm-F32.gguf"
ODD = "org/Odd-Projector-GGUF"  # a text model beside a projector of a type base does not read
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-repo")
    model, f32 = write_vision_gguf(folder, IDEFICS3)
    f16 = write_mmproj(folder / F16, IDEFICS3, "F16")
    assert (model.name, f32.name) == (MODEL, F32)
    with HubServer() as server:
        server.add_repo(VLM, {"README.md": b"# vlm\n", **{p.name: p.read_bytes() for p in (model, f32, f16)}})
        text, _ = tiny_llama_gguf(folder / "tiny.Q8_0.gguf", "Q8_0")
        server.add_repo(ODD, {text.name: text.read_bytes(), "mmproj-tiny-F16.gguf": pixtral_projector(folder)})
        server.files = {"model": model, "f32": f32, "f16": f16}
        yield server


def pixtral_projector(folder: Path) -> bytes:
    def metadata(writer) -> None:
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type("pixtral")

    return write_gguf(folder / "mmproj-pixtral.gguf", {}, metadata, arch="clip").read_bytes()


def run_pull(hub: HubServer, store: Store, ref: str, mmproj: MmprojChoice = DEFAULT_MMPROJ):
    client = HubClient(endpoint=hub.url, token="hf_none")
    supported = set(supported_model_types())
    return pull(ref, store=store, client=client, supported=supported, progress=NoProgress(), mmproj=mmproj)


def fetched_since(hub: HubServer, before: int) -> list[str]:
    return [p.rsplit("/", 1)[1] for m, p, _ in hub.requests[before:] if m == "GET" and "/resolve/" in p]


def logits(path: Path, mmproj: Path | None = None) -> np.ndarray:
    loaded = load_model(path, select_backend("cpu"), mmproj=mmproj)
    ids, images = IDEFICS3.prompt("1")
    return prompt_logits(loaded.model, ids, images)


def test_the_projector_llama_cpp_takes_comes_with_the_model_into_one_base_file(hub: HubServer, tmp_path: Path):
    before = len(hub.requests)
    stored = run_pull(hub, Store(tmp_path), VLM)
    assert fetched_since(hub, before) == [F32, MODEL]  # the projector first: 32 bits, as the model's F32
    assert (stored.ref, stored.source["mmproj"], stored.source["files"]) == (f"{VLM}:f32", F32, [MODEL, F32])
    assert "sha256" not in stored.source  # two files: no one digest the hub lists
    got = logits(stored.path)
    np.testing.assert_array_equal(got, logits(hub.files["model"], hub.files["f32"]))  # the local pair's
    np.testing.assert_allclose(got, IDEFICS3.reference()["logits_1"], rtol=0, atol=1e-4)  # transformers'


def test_the_pulled_model_answers_an_image_request_as_transformers_does(hub: HubServer, tmp_path: Path):
    engine = LLMEngine(load_model(run_pull(hub, Store(tmp_path), VLM).path, select_backend("cpu")))
    ids, images = IDEFICS3.prompt("1", engine.image_processor)
    engine.add_request(ids, GREEDY, images=images)
    answer: list[int] = []
    while engine.has_unfinished:
        for output in engine.step():
            answer += output.token_ids
    assert answer == IDEFICS3.reference()["greedy_1"].tolist()


def test_mmproj_takes_another_projector_of_the_repo(hub: HubServer, tmp_path: Path):
    before = len(hub.requests)
    stored = run_pull(hub, Store(tmp_path), VLM, MmprojChoice(F16))
    assert fetched_since(hub, before) == [F16, MODEL]
    assert stored.source["mmproj"] == F16
    np.testing.assert_array_equal(logits(stored.path), logits(hub.files["model"], hub.files["f16"]))


def test_no_mmproj_stores_the_text_model_alone(hub: HubServer, tmp_path: Path):
    before = len(hub.requests)
    stored = run_pull(hub, Store(tmp_path), VLM, MmprojChoice(wanted=False))
    assert fetched_since(hub, before) == [MODEL]
    base = BaseFile.open(stored.path)
    assert "vision_config" not in base.header["config"] and "mmproj" not in stored.source
    assert "vision" not in model_card(base)["capabilities"]
    assert LLMEngine(load_model(stored.path, select_backend("cpu"))).image_processor is None


def test_a_named_projector_the_repo_lacks_is_an_error_that_fetches_and_stores_nothing(hub: HubServer, tmp_path: Path):
    before, store = len(hub.requests), Store(tmp_path)
    message = f"{VLM} has no GGUF file 'mmproj-idefics3_vlm-Q8_0.gguf' to take as the vision projector; its projectors"
    with pytest.raises(ModelFileError, match=message):
        run_pull(hub, store, VLM, MmprojChoice("mmproj-idefics3_vlm-Q8_0.gguf"))
    assert fetched_since(hub, before) == [] and store.list() == []


def test_the_same_pull_again_fetches_nothing_and_another_projector_choice_replaces_the_model(
    hub: HubServer, tmp_path: Path
):
    store = Store(tmp_path)
    first = run_pull(hub, store, VLM)
    before = len(hub.requests)
    assert run_pull(hub, store, VLM) == first and fetched_since(hub, before) == []
    text = run_pull(hub, store, VLM, MmprojChoice(wanted=False))
    assert fetched_since(hub, before) == [MODEL]
    assert store.list() == [text] and text.ref == first.ref and "mmproj" not in text.source


def test_a_projector_left_by_a_killed_pull_is_resumed_where_it_stopped(hub: HubServer, tmp_path: Path):
    store = Store(tmp_path)
    partial = tmp_path / "downloads" / VLM / hub.repos[VLM].commit / f"{F32}.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(hub.files["f32"].read_bytes()[:50_000])
    before = len(hub.downloads_of(F32))
    stored = run_pull(hub, store, VLM)
    assert hub.downloads_of(F32)[before:] == ["bytes=50000-"]
    assert stored.source["mmproj"] == F32 and not (tmp_path / "downloads" / "org").exists()


def test_a_default_projector_base_cannot_read_leaves_the_text_model_with_a_note(
    hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture
):
    stored = run_pull(hub, Store(tmp_path), ODD)
    note = "projector type 'pixtral' is not supported (supported: gemma3, idefics3, qwen2.5vl_merger); storing the"
    assert note in capsys.readouterr().err
    assert stored.source["mmproj"] == "mmproj-tiny-F16.gguf" and "pixtral" in stored.source["mmproj_refused"]
    assert "vision_config" not in BaseFile.open(stored.path).header["config"]
    before = len(hub.requests)
    assert run_pull(hub, Store(tmp_path), ODD) == stored and fetched_since(hub, before) == []  # stored as asked


def test_a_named_projector_base_cannot_read_is_an_error(hub: HubServer, tmp_path: Path):
    store = Store(tmp_path)
    with pytest.raises(UnsupportedModelError, match="mmproj-tiny-F16.gguf: projector type 'pixtral' is not supported"):
        run_pull(hub, store, ODD, MmprojChoice("mmproj-tiny-F16.gguf"))
    assert store.list() == []


def base(*args: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "baselm.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_base_pull_show_and_doctor_say_the_model_takes_images(hub: HubServer, tmp_path: Path):
    env = {**os.environ, "BASE_HOME": str(tmp_path), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_none"}
    both = base("pull", VLM, "--mmproj", F16, "--no-mmproj", env=env)
    assert both.returncode == 1 and "--mmproj and --no-mmproj ask for opposite things" in both.stderr
    pulled = base("pull", VLM, "--quiet", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip() == f"{VLM}:f32"
    card = json.loads(base("show", f"{VLM}:f32", "--json", env=env).stdout)
    assert card["capabilities"] == ["completion", "embedding", "vision"] and card["source"]["mmproj"] == F32
    shown = [line.strip() for line in base("show", f"{VLM}:f32", env=env).stdout.splitlines()]
    at = shown.index("Capabilities")
    assert shown[at + 1 : at + 4] == ["completion", "embedding", "vision"]
    report = json.loads(base("doctor", f"{VLM}:f32", "--json", "--no-speed", env=env).stdout)["model"]
    assert report["images"] == "yes, through its vision tower"
