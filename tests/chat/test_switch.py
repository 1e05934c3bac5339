"""`/model`'s engine switch: the next model in place of the last, which is freed; a failed load
puts the last one back."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from baselm.backend import select_backend
from baselm.chat.switch import ModelSwitch
from baselm.config import EngineConfig
from baselm.loader import load_model
from baselm.sampling.defaults import NO_DEFAULTS
from baselm.sampling.params import SamplingParams
from baselm.store.errors import ModelFileError
from baselm.store.registry import UnknownModelError
from tests.tiny_model import write_model_folder


def load(ref: str):
    return load_model(ref, select_backend("cpu"))


def answer(switch: ModelSwitch, opened) -> list[int]:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    return opened.client.call(lambda engine: engine.generate([[1, 2, 3]], params)[0].completions[0].token_ids).result(
        30
    )


def test_a_switch_frees_the_last_model_and_a_failed_one_puts_it_back(tmp_path: Path):
    first_path = write_model_folder(tmp_path / "first", eos=False)
    second_path = write_model_folder(tmp_path / "second", eos=False, max_position_embeddings=1024)
    switch = ModelSwitch(load, EngineConfig(), NO_DEFAULTS, seed=0)
    first = load(str(first_path))
    gone = weakref.ref(first.model)
    opened = switch.open(first, str(first_path))
    before = answer(switch, opened)
    del first, opened
    opened = switch.switch(str(second_path))
    gc.collect()
    assert gone() is None  # nothing holds the first model any more: its memory can go
    assert (opened.client.engine.loaded.name, opened.client.engine.max_model_len) == ("second", 1024)
    assert len(answer(switch, opened)) == 4
    with pytest.raises(UnknownModelError):
        switch.switch(str(tmp_path / "missing"))  # does not resolve: nothing stops
    assert switch.ref == str(second_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        switch.switch(str(broken))
    assert switch.ref == str(second_path)  # loaded again
    switch.close()
    reopened = switch.switch(str(first_path))
    assert answer(switch, reopened) == before  # greedy: the same model gives the same answer
    switch.close()
