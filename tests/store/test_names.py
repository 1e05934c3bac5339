"""Names and content-addressed files: one file for the same bytes, `copy` adds a name, `remove`
frees a file only when no name points at it, and stores of the older layout keep working."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baselm.store.errors import StoreError
from baselm.store.registry import Store, UnknownModelError

INFO = {"arch": "llama", "params": 1234, "quant": "q4", "source": {"format": "gguf", "sha256": "ab" * 32}}


def put(store: Store, name: str, variant: str, content: bytes) -> None:
    with store.begin_write(name, variant) as pending:
        pending.temp_path.write_bytes(content)
        pending.commit(**INFO)


def blob_files(store: Store) -> list[str]:
    return sorted(p.name for p in store.blobs.root.iterdir() if p.name != ".lock")


def legacy_store(root: Path, name: str, variant: str, content: bytes) -> Path:
    """A model as the store kept it before blobs: the file beside a schema-1 manifest."""
    folder = root / "models" / name
    folder.mkdir(parents=True)
    (folder / f"{variant}.base").write_bytes(content)
    entry = {**INFO, "size": len(content), "pulled": "2026-01-01T00:00:00+00:00"}
    manifest = {"schema": 1, "name": name, "variants": {variant: entry}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder / f"{variant}.base"


def test_the_same_bytes_under_two_names_are_one_file(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/A", "q4", b"same bytes")
    put(store, "org/B", "q4", b"same bytes")
    a, b = store.list()
    assert a.path == b.path and a.digest == b.digest and len(blob_files(store)) == 1


def test_copy_adds_a_name_for_the_same_file_without_copying_it(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"model")
    copied = store.copy("tiny", "alice/mine")
    assert copied.ref == "alice/mine:q4" and copied.path == store.resolve("org/Tiny").path
    assert [m.ref for m in store.list()] == ["alice/mine:q4", "org/Tiny:q4"]
    assert blob_files(store) == [copied.path.name]
    assert store.copy("org/Tiny:q4", "solo:v2").ref == "local/solo:v2"


def test_copy_over_an_existing_name_repoints_it_and_frees_the_file_it_had(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/A", "q4", b"aaa")
    put(store, "org/B", "q4", b"bbbb")
    with pytest.raises(StoreError, match=r"org/B:q4 already names another model .*pass --force"):
        store.copy("org/A", "org/B", replace=False)  # `base cp` without --force
    assert store.resolve("org/B").size == 4 and len(blob_files(store)) == 2
    store.copy("org/A", "org/B")
    assert store.resolve("org/B").size == 3 and len(blob_files(store)) == 1
    assert store.copy("org/A", "org/B", replace=False).size == 3  # the same file already: nothing to refuse


def test_copy_onto_itself_or_from_nothing_is_a_clear_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"model")
    with pytest.raises(StoreError, match=r"'org/tiny:q4' is org/Tiny:q4 itself; give another name"):
        store.copy("org/Tiny", "org/tiny:q4")
    with pytest.raises(UnknownModelError, match="no stored model named 'nothing'"):
        store.copy("nothing", "org/x")
    with pytest.raises(StoreError, match="is not a model name"):
        store.copy("org/Tiny", "a/b/c")


def test_remove_keeps_the_file_while_another_name_points_at_it(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"model")
    store.copy("org/Tiny", "org/Other")
    removed = store.remove("org/Tiny")
    assert removed.ref == "org/Tiny:q4" and removed.path.is_file()
    assert [m.ref for m in store.list()] == ["org/Other:q4"]
    store.remove("org/Other")
    assert store.list() == [] and blob_files(store) == [] and not removed.path.exists()


def test_a_blob_left_without_a_name_by_a_killed_writer_goes_with_the_next_write(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.blobs.root.mkdir(parents=True)
    orphan = store.blobs.path("sha256-" + "0" * 64)
    orphan.write_bytes(b"published, then killed before the manifest")
    put(store, "org/Tiny", "q4", b"model")
    assert not orphan.exists() and len(blob_files(store)) == 1


def test_a_store_of_the_older_layout_is_listed_resolved_and_removed(tmp_path: Path) -> None:
    old = legacy_store(tmp_path, "org/Old", "q4", b"old model")
    store = Store(tmp_path)
    [model] = store.list()
    assert (model.ref, model.path, model.digest) == ("org/Old:q4", old, "")
    assert store.resolve("old:q4").path.read_bytes() == b"old model"
    store.remove("old")
    assert store.list() == [] and not old.exists() and not (tmp_path / "models/org").exists()


def test_copying_a_model_of_the_older_layout_moves_its_file_into_blobs_once(tmp_path: Path) -> None:
    old = legacy_store(tmp_path, "org/Old", "q4", b"old model")
    (old.parent / "q4.base.sig").write_text("{}")
    store = Store(tmp_path)
    copied = store.copy("org/Old", "org/New")
    assert not old.exists() and store.resolve("org/Old").path == copied.path == store.blobs.path(
        copied.digest.replace(":", "-")
    )
    assert copied.path.read_bytes() == b"old model" and Path(f"{copied.path}.sig").read_text() == "{}"
    manifest = json.loads((old.parent / "manifest.json").read_text())
    assert manifest["variants"]["q4"]["blob"] == copied.digest.replace(":", "-")


def test_a_new_write_over_a_name_of_the_older_layout_removes_its_old_file(tmp_path: Path) -> None:
    old = legacy_store(tmp_path, "org/Old", "q4", b"old model")
    store = Store(tmp_path)
    put(store, "org/Old", "q4", b"new model")
    assert not old.exists() and store.resolve("org/Old").path.read_bytes() == b"new model"


def test_find_source_names_a_model_made_from_the_same_source_as_the_same_variant(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"model")
    assert store.find_source("ab" * 32, "q4").ref == "org/Tiny:q4"
    assert store.find_source("ab" * 32, "q8") is None and store.find_source("cd" * 32, "q4") is None


def test_a_load_that_meets_its_file_moved_into_blobs_meanwhile_finds_it_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader resolved the name of an older-layout model just before `cp` moved its file into
    blobs/: the open misses the old path, and the loader resolves the name once more."""
    import baselm.loader as loader
    from baselm.backend import select_backend
    from baselm.store.import_local import import_local
    from tests.tiny_model import write_model_folder

    monkeypatch.setenv("BASE_HOME", str(tmp_path / "home"))
    stored = import_local(write_model_folder(tmp_path / "hf"), supported={"llama"}, store=Store(tmp_path / "made"))
    legacy_store(tmp_path / "home", "org/Old", "q4", stored.path.read_bytes())
    real_resolve = loader.resolve
    calls = []

    def resolve_then_move(ref):
        found = real_resolve(ref)
        if not calls:  # the first look: then `base cp` moves the file before the open
            Store(tmp_path / "home").copy("org/Old", "org/New")
        calls.append(found[1])
        return found

    monkeypatch.setattr(loader, "resolve", resolve_then_move)
    loaded = loader.load_model("org/Old", select_backend("cpu"))
    assert len(calls) == 2 and not calls[0].exists() and calls[1] == loaded.path and loaded.path.is_file()
