"""A vision-language model from a language-model GGUF and an mmproj GGUF, as llama.cpp's converter
writes them (tests/vision_gguf.py), is the HF folder's model: for each fixture family (Gemma 3,
SmolVLM / Idefics3, Qwen2.5-VL) its logits at every position of the reference prompts with their
images are the folder's (and transformers') within 1e-4, its chat template and vocabulary give the
same prompt ids, and it answers an image request with transformers' greedy ids. `base pull` of a
folder holding both files stores one `.base` that answers the same.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from baselm.backend import select_backend
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel, load_model
from baselm.sampling.params import SamplingParams
from baselm.store.base_reader import BaseFile
from baselm.store.errors import ModelFileError, StoreError, UnsupportedModelError
from baselm.store.gguf_mmproj import Mmproj
from baselm.store.hub import MmprojChoice
from baselm.store.import_local import import_local
from baselm.store.registry import Store
from tests.vision_fixture import GEMMA3, IDEFICS3, QWEN2_5_VL, prompt_logits
from tests.vision_gguf import write_vision_gguf

FIXTURES = {"gemma3": GEMMA3, "idefics3": IDEFICS3, "qwen2_5_vl": QWEN2_5_VL}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("vision-gguf")
    return {name: write_vision_gguf(folder, fixture) for name, fixture in FIXTURES.items()}


def _loaded(files: dict[str, tuple[Path, Path]], name: str) -> LoadedModel:
    model, mmproj = files[name]
    return load_model(model, select_backend("cpu"), mmproj=mmproj)


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("tag", ["1", "2"])
def test_logits_with_images_are_the_folders(files, name, tag):
    fixture = FIXTURES[name]
    loaded = _loaded(files, name)
    ids, images = fixture.prompt(tag)  # the folder's processor: the same pixels for both models
    got = prompt_logits(loaded.model, ids, images)
    np.testing.assert_allclose(got, fixture.reference()[f"logits_{tag}"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "idefics3"])
def test_the_gguf_model_places_an_image_as_the_folder_does_and_answers_as_transformers(files, name):
    fixture = FIXTURES[name]
    engine = LLMEngine(_loaded(files, name))
    ids, images = fixture.prompt("1", engine.image_processor)
    assert ids == fixture.reference()["input_ids_1"].tolist()
    assert _greedy(engine, ids, images) == fixture.reference()["greedy_1"].tolist()


def test_qwen2_5_vl_from_gguf_answers_as_the_folder_with_the_same_pixel_budget(files):
    """The GGUF's budget is mtmd's (below), not the folder's: both models read the image so placed."""
    engine = LLMEngine(_loaded(files, "qwen2_5_vl"))
    ids, images = QWEN2_5_VL.prompt("1", engine.image_processor)
    assert images[0].pixels.shape[:2] == (4, 5)  # 30x40 -> 32x40 pixels: 4 x 5 merged tokens, in the budget
    folder_ids, folder_images = QWEN2_5_VL.prompt("1", engine.image_processor)
    assert folder_ids == ids
    assert _greedy(engine, ids, images) == _greedy(LLMEngine(QWEN2_5_VL.loaded()), folder_ids, folder_images)


def test_qwen2_5_vl_pixel_budget_is_mtmds_when_the_file_gives_none(files):
    """Without clip.vision.image_min_pixels/max_pixels, 8 to 4096 tokens of (patch * merge)^2 pixels."""
    config = _loaded(files, "qwen2_5_vl").config
    assert config["preprocessor_config"]["min_pixels"] == 8 * 8**2
    assert config["preprocessor_config"]["max_pixels"] == 4096 * 8**2
    assert config["vision_config"]["fullatt_block_indexes"] == [1, 3]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


def _greedy(engine: LLMEngine, ids, images) -> list[int]:
    engine.add_request(ids, GREEDY, images=images)
    out: list[int] = []
    while engine.has_unfinished:
        for o in engine.step():
            out += o.token_ids
    return out


def test_a_folder_of_both_files_loads_with_its_projector_and_pulls_into_one_base_file(files, tmp_path):
    folder = tmp_path / "smolvlm-gguf"
    folder.mkdir()
    for path in files["idefics3"]:
        shutil.copy(path, folder / path.name)
    engine = LLMEngine(load_model(folder, select_backend("cpu")))
    assert engine.image_processor is not None
    stored = import_local(folder, supported=None, store=Store(tmp_path / "store"))
    assert stored.path.suffix == ".base"
    pulled = LLMEngine(load_model(stored.path, select_backend("cpu")))
    ids, images = IDEFICS3.prompt("1", pulled.image_processor)
    assert _greedy(pulled, ids, images) == IDEFICS3.reference()["greedy_1"].tolist()


def test_a_local_gguf_takes_the_projector_mmproj_names_and_no_mmproj_leaves_a_folders_out(files, tmp_path):
    model, projector = files["idefics3"]
    store = Store(tmp_path / "store")
    paired = import_local(model, supported=None, store=store, mmproj=MmprojChoice(str(projector)))
    assert paired.source["mmproj"] == str(projector)
    assert "vision_config" in BaseFile.open(paired.path).header["config"]
    folder = tmp_path / "both"
    folder.mkdir()
    for path in files["idefics3"]:
        shutil.copy(path, folder / path.name)
    assert import_local(folder, supported=None, store=store) == paired  # the same two files: not converted again
    text = import_local(folder, supported=None, store=Store(tmp_path / "text"), mmproj=MmprojChoice(wanted=False))
    assert "vision_config" not in BaseFile.open(text.path).header["config"] and "mmproj" not in text.source
    with pytest.raises(StoreError, match="--mmproj goes with a .gguf language model, not idefics3_vlm"):
        import_local(IDEFICS3.folder, supported=None, store=store, mmproj=MmprojChoice(str(projector)))
    with pytest.raises(StoreError, match="--mmproj .*no-such.gguf: no such file"):
        import_local(model, supported=None, store=store, mmproj=MmprojChoice(str(tmp_path / "no-such.gguf")))


def test_a_language_model_gguf_is_not_a_projector(files):
    with pytest.raises(ModelFileError, match=r"is not a vision projector \(its general.architecture is 'gemma3'"):
        Mmproj.open(files["gemma3"][0])


def test_another_models_projector_is_refused(files):
    model, _ = files["idefics3"]
    with pytest.raises(ModelFileError, match="lacks <image_soft_token>.*is not its projector"):
        load_model(model, select_backend("cpu"), mmproj=files["gemma3"][1])


def test_mmproj_goes_with_a_gguf_model(files):
    with pytest.raises(ModelFileError, match="--mmproj goes with a .gguf language model"):
        load_model(GEMMA3.folder, select_backend("cpu"), mmproj=files["gemma3"][1])


def test_an_unknown_projector_type_is_refused(tmp_path):
    from tests.tiny_gguf import write_gguf

    def metadata(writer):
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type("pixtral")

    path = write_gguf(tmp_path / "mmproj-x.gguf", {}, metadata, arch="clip")
    with pytest.raises(UnsupportedModelError, match="projector type 'pixtral' is not supported"):
        Mmproj.open(path)


def _base(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baselm.cli", *args], capture_output=True, text=True, timeout=120)


def test_base_run_takes_the_projector_with_mmproj(files):
    model, mmproj = files["idefics3"]
    result = _base(
        "run", str(model), "--mmproj", str(mmproj), "hello", "--json", "--max-tokens", "3", "--device", "cpu"
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 3


def test_base_run_says_what_is_wrong_with_a_projector_for_a_folder(files):
    result = _base("run", str(IDEFICS3.folder), "--mmproj", str(files["idefics3"][1]), "hello", "--device", "cpu")
    assert result.returncode == 1
    assert "--mmproj goes with a .gguf language model, not idefics3_vlm" in result.stderr
