"""Split GGUFs (`NAME-00001-of-00003.gguf`, as gguf-split writes them, here by the `gguf` package):
opened from the first part or their folder, they are the model the unsplit file is; a missing,
later or foreign part is a clear error naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from baselm.backend import Backend
from baselm.loader import load_model
from baselm.store.errors import ModelFileError
from baselm.store.gguf import GGUFFile
from baselm.store.import_local import import_local
from baselm.store.registry import Store
from tests.forward import prefill_logits
from tests.tiny_gguf import tiny_llama_gguf

CPU = Backend("cpu", mx.float32, keep_quantized=False)
IDS = np.array([1, 17, 42, 99, 7, 200, 3, 64, 128, 5])


@pytest.fixture
def split(tmp_path: Path) -> Path:
    """The tiny llama as Q8_0, in three parts of at most 8 tensors (21 in all), in a folder of its own."""
    (tmp_path / "split").mkdir()
    return tiny_llama_gguf(tmp_path / "split" / "Tiny.Q8_0.gguf", "Q8_0", split_max_tensors=8)[0]


@pytest.fixture
def whole(tmp_path: Path) -> Path:
    (tmp_path / "whole").mkdir()
    return tiny_llama_gguf(tmp_path / "whole" / "Tiny.Q8_0.gguf", "Q8_0")[0]


def test_gguf_writes_the_parts_as_gguf_split_names_them(split):
    names = sorted(p.name for p in split.parent.iterdir())
    assert names == [f"Tiny.Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split.name == names[0]


def test_a_split_gguf_opened_from_its_first_part_has_every_part_s_tensors(split, whole):
    parts, one = GGUFFile.open(split), GGUFFile.open(whole)
    assert parts.tensors.keys() == one.tensors.keys() and len(parts.tensors) == 21
    assert sorted({info.part for info in parts.tensors.values()}) == [0, 1, 2]
    assert all(np.array_equal(parts.raw(parts.tensors[n]), one.raw(one.tensors[n])) for n in one.tensors)
    assert parts.metadata["split.count"] == 3 and parts.metadata["general.architecture"] == "llama"


def test_a_split_gguf_runs_from_its_first_part_or_its_folder_with_the_whole_file_s_logits(split, whole):
    expected = prefill_logits(load_model(whole, CPU).model, IDS)
    assert np.array_equal(prefill_logits(load_model(split, CPU).model, IDS), expected)
    assert np.array_equal(prefill_logits(load_model(split.parent, CPU).model, IDS), expected)


def test_a_split_gguf_is_pulled_from_its_folder_under_the_name_without_the_part_suffix(split, tmp_path, monkeypatch):
    monkeypatch.setenv("BASE_HOME", str(tmp_path / "home"))
    model = import_local(split.parent, supported={"llama"}, store=Store(tmp_path / "home"))
    assert (model.ref, model.source["format"], model.source["path"]) == ("local/Tiny:q8_0", "gguf", str(split))
    assert import_local(split, supported={"llama"}, store=Store(tmp_path / "home")).ref == model.ref  # same bytes


def test_a_missing_part_is_named(split):
    (split.parent / "Tiny.Q8_0-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelFileError, match=r"part\(s\) Tiny.Q8_0-00002-of-00003.gguf of this 3-part GGUF"):
        GGUFFile.open(split)


def test_a_later_part_names_the_first_one_to_open(split):
    with pytest.raises(ModelFileError, match="not the first part of a split GGUF; open Tiny.Q8_0-00001-of-00003.gguf"):
        GGUFFile.open(split.parent / "Tiny.Q8_0-00002-of-00003.gguf")


def test_parts_out_of_order_are_refused(split):
    second, third = (split.parent / f"Tiny.Q8_0-0000{i}-of-00003.gguf" for i in (2, 3))
    second.rename(split.parent / "tmp.gguf")
    third.rename(second)
    (split.parent / "tmp.gguf").rename(third)
    with pytest.raises(ModelFileError, match="says it is part 2 of 3, where part 1 of 3 belongs"):
        GGUFFile.open(split)


def test_a_renamed_first_part_cannot_find_its_parts(split):
    renamed = split.parent / "Tiny.gguf"
    shutil.copy(split, renamed)
    with pytest.raises(ModelFileError, match="part of a GGUF split into 3 files, but not named"):
        GGUFFile.open(renamed)


def test_a_folder_of_two_gguf_models_asks_for_one(split, whole):
    shutil.copy(whole, split.parent / "Other.gguf")
    with pytest.raises(ModelFileError, match="holds more than one GGUF model"):
        load_model(split.parent, CPU)
