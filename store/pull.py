"""`base pull org/name[:tag]`: a model from the hub into the store as a `.base` file.

The tag picks the variant (see `variants.py`): for a safetensors repo a quant scheme and/or a
profile, for a GGUF repo the `.gguf` file by its quant (`Q4_0`, `q8_0`, `Q4_K_M`). The files a
model needs are downloaded (see `hub.py`) and converted (see `convert.py`); a local path is
`import_local.py`'s. A GGUF repo's vision projector (`mmproj*.gguf`) comes too, as llama.cpp's
`-hf` picks it (or as named, or none), and is stored with the model in one `.base` file; it is
fetched first and its header read, so a projector base cannot read costs one small file: one
picked by default is then left out with a note (the text model is stored), one named is an error.

The whole pull of one model runs under the store's lock for that model: downloads resume
from `.part` files left by an interrupted pull, the `.base` file is written under a temp name,
and the model appears in the store only once it is complete (see `store/registry.py`).
Downloaded sources are removed after a successful pull unless `keep_download`. A GGUF whose
sha256 (as the hub lists it) the store already holds as the asked variant is not downloaded:
the name points at the stored file.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from baselm.store import hf
from baselm.store.convert import convert
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.gguf_mmproj import Mmproj
from baselm.store.hub import (
    DEFAULT_MMPROJ,
    HubClient,
    MmprojChoice,
    RepoSnapshot,
    Selection,
    check_model_type,
    select_files,
)
from baselm.store.progress import NoProgress, Progress, default_progress
from baselm.store.registry import PendingWrite, Store, StoredModel, check_model_name, split_ref
from baselm.store.variants import plan_variant


def pull(
    ref: str,
    *,
    store: Store | None = None,
    quant: str | None = None,
    profile: str | None = None,
    group_size: int | None = None,
    revision: str = "main",
    supported: Iterable[str] | None = None,
    client: HubClient | None = None,
    progress: Progress | None = None,
    force: bool = False,
    keep_download: bool = False,
    convert_progress: Progress | None = None,
    mmproj: MmprojChoice = DEFAULT_MMPROJ,
) -> StoredModel:
    """Pulls `org/name[:tag]` into the store and returns the stored model.

    `supported` (the model_types base can run) is checked against config.json before any
    weights are fetched; None skips the check. A variant already stored from the same commit and
    vision projector is returned as it is unless `force`. `progress` hears of each download (bytes),
    `convert_progress` of the conversion (tensors; none by default). `mmproj`: a GGUF's projector.
    """
    store = store or Store()
    repo, tag = split_ref(ref)
    check_model_name(repo)
    client = client or HubClient()
    progress = progress or default_progress()
    snapshot = client.snapshot(repo, revision)
    repo = snapshot.repo
    selection = select_files(snapshot, tag, mmproj)
    plan = plan_variant(selection, tag, quant, profile, group_size)
    with store.begin_write(repo, plan.variant, on_wait=lambda: wait_note(repo)) as pending:
        source = _source_info(snapshot, selection)
        stored = None if force else _stored_already(store, pending, selection, source, plan.variant)
        if stored is not None:
            return stored
        downloads = store.downloads_dir / repo
        _remove_other_commits(downloads, snapshot.commit)
        store.check_free_space(2 * selection.num_bytes)  # the download, and at most as much again for the .base
        folder = downloads / snapshot.commit
        projector, refusal = _download_projector(client, snapshot, selection, folder, progress, mmproj.name is not None)
        if refusal is not None:
            source["mmproj_refused"] = refusal
        converted = convert(
            _download(client, snapshot, selection, folder, supported, progress),
            pending.temp_path,
            plan.quant,
            plan.group_size,
            plan.profile,
            source,
            supported,
            convert_progress or NoProgress(),
            mmproj=projector,
        )
        stored = converted.commit(pending, source)
        if not keep_download:
            shutil.rmtree(downloads, ignore_errors=True)
            _remove_empty_dir(downloads.parent)
    return stored


def _stored_already(
    store: Store, pending: PendingWrite, selection: Selection, source: dict[str, Any], variant: str
) -> StoredModel | None:
    """What a pull returns without downloading: the variant stored from the same commit and vision
    projector, or a name for the same GGUF stored already (imported, or pulled under another name)."""
    existing = pending.existing
    if existing and all(existing.source.get(key) == source.get(key) for key in ("commit", "mmproj")):
        return existing
    listed_sha256 = _gguf_sha256(selection)
    same = store.find_source(listed_sha256, variant) if listed_sha256 else None
    return pending.link(same, source) if same is not None else None


def wait_note(name: str) -> None:
    """What a pull prints when another process is pulling the same model."""
    print(f"waiting for another pull of {name} to finish", file=sys.stderr, flush=True)


def _download(
    client: HubClient,
    snapshot: RepoSnapshot,
    selection: Selection,
    folder: Path,
    supported: Iterable[str] | None,
    progress: Progress,
) -> Path:
    """Fetches the selection into `folder`; returns the folder (safetensors) or the .gguf file (a
    split one's first part)."""
    if selection.kind == "gguf":
        return [client.download(snapshot, file, folder, progress) for file in selection.files][0]
    config_file = next(f for f in selection.files if f.path == "config.json")
    config_path = client.download(snapshot, config_file, folder, progress)
    if supported is not None:  # before any weights: an unsupported model costs one small file
        check_model_type(hf.read_json(config_path), supported, snapshot.repo)
    for file in selection.files:
        if file is not config_file:
            client.download(snapshot, file, folder, progress)
    return folder


def _download_projector(
    client: HubClient, snapshot: RepoSnapshot, selection: Selection, folder: Path, progress: Progress, named: bool
) -> tuple[Path | None, str | None]:
    """Fetches the selection's vision projector into `folder` and reads its header: (its path, None),
    or (None, why) when base cannot read the one picked by default (a note says so, and the text
    model is stored). A projector the user named that base cannot read is an error."""
    if selection.mmproj is None:
        return None, None
    path = client.download(snapshot, selection.mmproj, folder, progress)
    try:
        Mmproj.open(path)
    except (ModelFileError, UnsupportedModelError) as exc:
        if named:
            raise
        print(f"{exc}; storing the text model alone (--mmproj names another projector)", file=sys.stderr, flush=True)
        return None, str(exc)
    return path, None


def _remove_other_commits(downloads: Path, commit: str) -> None:
    """Partial downloads of other commits cannot be resumed any more."""
    if downloads.is_dir():
        for path in downloads.iterdir():
            if path.name != commit:
                shutil.rmtree(path, ignore_errors=True)


def _remove_empty_dir(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty: other models' downloads


def _source_info(snapshot: RepoSnapshot, selection: Selection) -> dict[str, Any]:
    info: dict[str, Any] = {
        "format": selection.kind,
        "repo": snapshot.repo,
        "revision": snapshot.revision,
        "commit": snapshot.commit,
        "files": [f.path for f in selection.files],
    }
    if selection.mmproj is not None:
        info["files"].append(selection.mmproj.path)
        info["mmproj"] = selection.mmproj.path
    if _gguf_sha256(selection):
        info["sha256"] = _gguf_sha256(selection)
    return info


def _gguf_sha256(selection: Selection) -> str | None:
    """The sha256 the hub lists for a one-file GGUF: how the same file is known when stored already.
    A split GGUF's parts, or a GGUF with its projector, have no one digest the hub lists (their
    import digest covers every file)."""
    one_file = selection.kind == "gguf" and len(selection.files) == 1 and selection.mmproj is None
    return selection.files[0].sha256 if one_file else None
