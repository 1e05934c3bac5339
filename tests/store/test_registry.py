"""The local model store: layout, references and aliases, removal, crash safety and locking."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from baselm.store.errors import StoreError
from baselm.store.registry import AmbiguousModelError, NoSpaceError, Store, UnknownModelError

INFO = {"arch": "llama", "params": 1234, "quant": "q4", "source": {"format": "safetensors", "commit": "c" * 40}}


def put(store: Store, name: str, variant: str, content: bytes = b"BASE-model-bytes") -> None:
    with store.begin_write(name, variant) as pending:
        pending.temp_path.write_bytes(content)
        pending.commit(**INFO)


def test_a_stored_model_is_listed_with_what_it_holds(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "HuggingFaceTB/SmolLM2-135M-Instruct", "q4", b"x" * 100)
    [model] = store.list()
    assert model.ref == "HuggingFaceTB/SmolLM2-135M-Instruct:q4"
    digest = hashlib.sha256(b"x" * 100).hexdigest()
    assert model.path == tmp_path / f"blobs/sha256-{digest}.base" and model.digest == f"sha256:{digest}"
    assert (model.arch, model.params, model.size, model.quant) == ("llama", 1234, 100, "q4")
    assert model.source == INFO["source"] and model.pulled.endswith("+00:00")
    manifest = json.loads((tmp_path / "models/HuggingFaceTB/SmolLM2-135M-Instruct/manifest.json").read_text())
    assert manifest["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and list(manifest["variants"]) == ["q4"]
    assert manifest["variants"]["q4"]["blob"] == f"sha256-{digest}"


@pytest.mark.parametrize(
    "ref",
    [
        "HuggingFaceTB/SmolLM2-135M-Instruct:q4",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "huggingfacetb/smollm2-135m-instruct",
        "SmolLM2-135M-Instruct",
        "smollm2-135m-instruct",
        "smollm2-135m-instruct:Q4",
    ],
)
def test_references_and_short_aliases_resolve_to_the_one_stored_model(tmp_path: Path, ref: str) -> None:
    store = Store(tmp_path)
    put(store, "HuggingFaceTB/SmolLM2-135M-Instruct", "q4")
    assert store.resolve(ref).ref == "HuggingFaceTB/SmolLM2-135M-Instruct:q4"


def test_a_bare_name_with_several_variants_is_ambiguous_and_lists_them(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4")
    put(store, "org/Tiny", "q8")
    with pytest.raises(AmbiguousModelError, match=r"'tiny' matches several stored models: org/Tiny:q4, org/Tiny:q8"):
        store.resolve("tiny")
    assert store.resolve("tiny:q8").variant == "q8"


def test_the_same_name_in_two_orgs_needs_the_org(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "alice/Tiny", "q4")
    put(store, "bob/Tiny", "q4")
    with pytest.raises(AmbiguousModelError, match="alice/Tiny:q4, bob/Tiny:q4"):
        store.resolve("Tiny:q4")
    assert store.resolve("bob/tiny").name == "bob/Tiny"


def test_an_unknown_name_suggests_close_matches(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "HuggingFaceTB/SmolLM2-135M-Instruct", "q4")
    with pytest.raises(
        UnknownModelError, match=r"no stored model named 'smollm2-135m-instrct'; did you mean SmolLM2-135M-Instruct\?"
    ):
        store.resolve("smollm2-135m-instrct")
    with pytest.raises(UnknownModelError, match=r"no stored model named 'llama-3'; `base list` shows"):
        store.resolve("llama-3")


def test_an_unknown_variant_lists_the_stored_ones(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4")
    with pytest.raises(UnknownModelError, match=r"org/Tiny has no variant 'q8'; stored: org/Tiny:q4"):
        store.resolve("org/Tiny:q8")


def test_add_copies_a_finished_file_into_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    source = tmp_path / "made.base"
    source.write_bytes(b"x" * 10)
    model = store.add("org/Tiny", "q8", source, **INFO)
    assert (model.path.read_bytes(), model.size, source.exists()) == (b"x" * 10, 10, True)
    assert store.list() == [model]


def test_remove_deletes_the_file_and_the_entry(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"four")
    put(store, "org/Tiny", "q8", b"eight")
    removed = store.remove("org/Tiny:q4")
    assert not removed.path.exists()
    assert [m.ref for m in store.list()] == ["org/Tiny:q8"]
    store.remove("tiny")
    assert store.list() == []
    assert not (tmp_path / "models/org").exists()
    assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [".lock"]


def test_an_abandoned_write_publishes_nothing_and_leaves_no_file(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.begin_write("org/Tiny", "q4") as pending:
            pending.temp_path.write_bytes(b"half a model")
            raise RuntimeError("conversion failed")
    assert store.list() == []
    assert sorted(p.name for p in (tmp_path / "models/org/Tiny").iterdir()) == [".lock"]


def test_a_file_that_no_longer_matches_its_entry_is_not_listed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put(store, "org/Tiny", "q4", b"x" * 100)
    path = store.resolve("tiny").path
    path.write_bytes(b"x" * 50)
    assert store.list() == []
    path.unlink()
    assert store.list() == []


_WRITER = """
import sys, time
from baselm.store.registry import Store
with Store(sys.argv[1]).begin_write("org/Tiny", "q4") as pending:
    with open(pending.temp_path, "wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
"""


def test_a_writer_killed_mid_write_leaves_nothing_listed_and_its_temp_file_is_cleaned(tmp_path: Path) -> None:
    store = Store(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=10)
    folder = tmp_path / "models/org/Tiny"
    assert [p.name for p in folder.iterdir() if p.name.endswith(".partial.base")] == [f".q4.{child.pid}.partial.base"]
    assert store.list() == []
    put(store, "org/Tiny", "q8")  # the next writer of the model removes the dead writer's file
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "manifest.json"]


def test_a_second_writer_waits_for_the_first_and_then_sees_its_model(tmp_path: Path) -> None:
    store = Store(tmp_path)
    events: list[str] = []
    first_has_lock = threading.Event()
    second_waits = threading.Event()

    def first() -> None:
        with store.begin_write("org/Tiny", "q4") as pending:
            first_has_lock.set()
            # Commit only once the second writer has found the lock taken (on_wait runs just before it blocks).
            if not second_waits.wait(60):
                events.append("the second writer never waited")
            pending.temp_path.write_bytes(b"model")
            pending.commit(**INFO)
            events.append("first committed")

    def on_wait() -> None:
        events.append("second waits")
        second_waits.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert first_has_lock.wait(60), "the first writer never took the lock"
    with store.begin_write("org/Tiny", "q4", on_wait=on_wait) as pending:
        events.append(f"second sees {pending.existing.ref if pending.existing else None}")
    thread.join(60)
    assert not thread.is_alive()
    assert events == ["second waits", "first committed", "second sees org/Tiny:q4"]


def test_a_full_disk_is_a_clear_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(NoSpaceError, match="no space left on the disk holding .*set BASE_HOME to another disk"):
        with store.begin_write("org/Tiny", "q4"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(NoSpaceError, match=r"not enough disk space .*: need 1048576\.00 GiB"):
        store.check_free_space(2**50)


@pytest.mark.parametrize("name", ["../etc/passwd", "noorg", "a/b/c", "org/.hidden", "org\n/name\n", "org/name\n"])
def test_names_that_are_not_org_slash_name_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(StoreError, match="is not a model name; use org/name"):
        put(Store(tmp_path), name, "q4")


def test_a_variant_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is not a variant name"):
        put(Store(tmp_path), "org/name", "q4\n")


def test_the_default_root_is_base_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_HOME", str(tmp_path))
    assert Store().models_dir == tmp_path / "models"
