"""What a local import is named, and that the same source is converted and stored once."""

from __future__ import annotations

from pathlib import Path

import pytest

import baselm.store.import_local as import_module
from baselm.commands.store import stored_summary
from baselm.store.base_reader import BaseFile
from baselm.store.import_local import import_local
from baselm.store.model_card import model_card
from baselm.store.registry import Store
from tests.tiny_gguf import tiny_llama_gguf

SUPPORTED = {"llama"}


def with_names(writer) -> None:
    writer.add_string("general.organization", "Tiny Org")
    writer.add_string("general.basename", "Tiny-Llama")
    writer.add_string("general.size_label", "1M")
    writer.add_string("general.finetune", "Instruct")
    writer.add_string("general.name", "Tiny Llama 1M Instruct")


def test_a_gguf_is_named_from_its_own_metadata(tmp_path: Path) -> None:
    path, _ = tiny_llama_gguf(tmp_path / "downloaded.Q8_0.gguf", "Q8_0", more=with_names)
    model = import_local(path, supported=SUPPORTED, store=Store(tmp_path / "home"))
    assert model.ref == "Tiny-Org/Tiny-Llama-1M-Instruct:q8_0"


def test_a_gguf_without_an_organization_goes_under_local_with_its_metadata_name(tmp_path: Path) -> None:
    path, _ = tiny_llama_gguf(
        tmp_path / "x.Q8_0.gguf", "Q8_0", more=lambda w: w.add_string("general.name", "Tiny Llama")
    )
    assert import_local(path, supported=SUPPORTED, store=Store(tmp_path / "home")).ref == "local/Tiny-Llama:q8_0"


def test_the_same_gguf_under_a_second_name_is_not_converted_or_stored_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "home")
    path, _ = tiny_llama_gguf(tmp_path / "m.Q8_0.gguf", "Q8_0", more=with_names)
    first = import_local(path, supported=SUPPORTED, store=store)
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(import_module, "convert", no_conversion)
    second = import_local(copy, name="alice/tiny", supported=SUPPORTED, store=store)
    assert (second.ref, second.path) == ("alice/tiny:q8_0", first.path)
    assert second.source["path"] == str(copy) and len(list(store.blobs.root.glob("*.base"))) == 1
    assert import_local(copy, supported=SUPPORTED, store=store) == first  # no --name: the stored model


def test_the_same_gguf_as_another_variant_is_converted(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    path, _ = tiny_llama_gguf(tmp_path / "m.Q8_0.gguf", "Q8_0", more=with_names)
    first = import_local(path, supported=SUPPORTED, store=store)
    second = import_local(path, quant="q4", supported=SUPPORTED, store=store)
    assert second.variant == "q4" and second.path != first.path


def test_a_conversion_counts_the_tensors_kept_exactly_requantized_and_float(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    path, _ = tiny_llama_gguf(tmp_path / "m.Q4_1.gguf", "Q4_1", more=with_names)
    kept = import_local(path, supported=SUPPORTED, store=store)
    base = BaseFile.open(kept.path)
    floats = sum(1 for entry in base.tensors.values() if entry.dtype in ("f32", "f16", "bf16"))
    num_tensors = len(base.tensors)
    assert {entry.dtype for entry in base.tensors.values()} == {"gguf_q4_1", "f32"}  # the file's blocks, kept
    assert kept.source["tensors"] == {"exact": num_tensors - floats, "float": floats}
    assert base.header["quant_profile"] == "gguf-Q4_1"
    # Q4_1 blocks fit q8 exactly (widened) but not q3: those are quantized again from their values.
    assert import_local(path, quant="q8", supported=SUPPORTED, store=store).source["tensors"]["exact"] > 0
    fewer = import_local(path, quant="q3", supported=SUPPORTED, store=store).source["tensors"]
    assert fewer.get("requantized", 0) > 0 and sum(fewer.values()) == num_tensors
    alias = import_local(path, name="alice/same", supported=SUPPORTED, store=store)  # the same bytes: linked
    assert alias.path == kept.path and alias.source["tensors"] == kept.source["tensors"]
    summary = stored_summary(kept, 1.0)
    assert f"({num_tensors} tensors: {num_tensors - floats} kept exactly, {floats} float)" in summary


def test_a_ggufs_license_is_kept_for_show(tmp_path: Path) -> None:
    path, _ = tiny_llama_gguf(
        tmp_path / "m.Q8_0.gguf", "Q8_0", more=lambda w: (with_names(w), w.add_string("general.license", "mit"))
    )
    stored = import_local(path, supported=SUPPORTED, store=Store(tmp_path / "home"))
    assert model_card(BaseFile.open(stored.path))["license"] == "mit"
