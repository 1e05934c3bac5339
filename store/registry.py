"""The local model store: names (`org/name[:variant]`) in manifests, pointing at content-addressed files.

Layout:

    $BASE_HOME/blobs/sha256-<hex>.base   each stored model file once, named by its digest (see blobs.py)
    $BASE_HOME/models/<org>/<name>/
        manifest.json      {"schema": 2, "name": "org/name", "variants": {variant: entry}}; an entry
                           names its file by `blob`; several names may point at one blob
        .lock              flock'd by whoever writes or removes this model
        .<anything>        a write in progress (temp .base files, temp manifests)
        <variant>.base     the older layout (schema 1: an entry without `blob`), still read;
                           such a file moves into blobs/ the first time another name needs it

A model is addressed by `org/name:variant`; `org/name` alone works when it has one variant;
`name` alone (any letter case, e.g. `smollm2-135m-instruct`) works when one stored model has
that name. An ambiguous reference is an error that lists the candidates: the store never
guesses between variants. `copy` gives a stored file a second name (no bytes copied); `remove`
removes a name, and its file once no name points at it.

NOTE: crash safety. A variant is in a manifest only after its file is complete: the file is
written under a dot-name, fsynced, hashed and renamed into blobs/, and only then is the
manifest rewritten (temp, fsync, rename). `list` and `resolve` read manifests only and skip
entries whose file is absent or has another size, so a kill at any point leaves nothing
half-made visible; a blob left without a name by a kill is removed by the next write. Dot-files
left by a killed writer are removed by the next writer of that model, which holds the model's lock.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baselm.store.blobs import Blobs, blob_digest, file_sha256
from baselm.store.default_model import base_home
from baselm.store.errors import StoreError
from baselm.store.fs import atomic_write, publish

MANIFEST = "manifest.json"
LOCK = ".lock"
MANIFEST_SCHEMA = 2  # 1: files beside the manifest, without `blob` (still read)
LOCAL_ORG = "local"  # the org of a name given without one
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # NOTE: fullmatch: `$` would take a trailing newline


class UnknownModelError(StoreError):
    """No stored model matches a reference."""


class AmbiguousModelError(StoreError):
    """A short reference matches several stored models or variants."""


class NoSpaceError(StoreError):
    """The disk holding the store is full."""


@dataclass(frozen=True, slots=True)
class StoredModel:
    """One stored variant of a model: its file and what it holds."""

    name: str  # "org/name", as the hub spells it
    variant: str  # quant scheme or profile, e.g. "q4"
    path: Path
    arch: str  # HF model_type
    params: int  # number of weights
    size: int  # bytes of the .base file
    quant: str  # quant scheme of the body, e.g. "q4"
    source: dict[str, Any] = field(default_factory=dict)  # format, repo, revision, commit, files
    pulled: str = ""  # ISO 8601 UTC
    digest: str = ""  # "sha256:<hex>" of the file; "" for a file of the older layout not yet hashed

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.variant}"

    @property
    def short_name(self) -> str:
        return self.name.split("/", 1)[1]


def split_ref(ref: str) -> tuple[str, str | None]:
    """`org/name:variant` -> ("org/name", "variant"); the variant is None when absent."""
    head, sep, tail = ref.strip().rpartition(":")
    if sep and head and tail and "/" not in tail:
        return head, tail
    return ref.strip(), None


def check_model_name(name: str) -> tuple[str, str]:
    """(org, name) of an `org/name` reference, or a clear error."""
    parts = name.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) and ".." not in p for p in parts):
        raise StoreError(f"{name!r} is not a model name; use org/name as on the Hugging Face hub")
    return parts[0], parts[1]


def check_variant(variant: str) -> str:
    if not _PART.fullmatch(variant) or ".." in variant:
        raise StoreError(f"{variant!r} is not a variant name; use letters, digits, '.', '_' or '-'")
    return variant


def qualify_name(name: str) -> str:
    """`org/name` as given, or `name` alone under `local/`; a clear error for anything else."""
    full = name if "/" in name else f"{LOCAL_ORG}/{name}"
    check_model_name(full)
    return full


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def _no_space(path: Path) -> NoSpaceError:
    free = shutil.disk_usage(path).free if path.exists() else 0
    return NoSpaceError(
        f"no space left on the disk holding {path} ({free / 2**30:.1f} GiB free); free some space or set BASE_HOME to "
        "another disk"
    )


@dataclass(slots=True)
class PendingWrite:
    """A variant being written: fill `temp_path`, then `commit` to publish it (or `link` an existing file)."""

    store: Store
    name: str
    variant: str
    folder: Path
    temp_path: Path  # write the .base file here (a dot-name: invisible to list, removed if abandoned)
    existing: StoredModel | None  # what the store holds for this variant now, if anything

    def commit(
        self, *, arch: str, params: int, quant: str, source: dict[str, Any], signature: dict[str, Any] | None = None
    ) -> StoredModel:
        """Hashes the finished file, moves it into blobs/ (or drops it when those bytes are stored
        already), then points this name at it (in that order).

        `signature`: a checked detached signature that came with the file, stored beside its blob."""
        from baselm.store.signing import write_sidecar  # cryptography (~9 MiB): not on every command

        if not self.temp_path.is_file():
            raise StoreError(f"nothing was written to {self.temp_path}; the model was not stored")
        hex_digest = file_sha256(self.temp_path)  # before the lock: it reads the whole file
        entry = {"arch": arch, "params": int(params), "size": self.temp_path.stat().st_size, "quant": quant}
        entry.update(source=source, pulled=_now())
        with self.store.blobs.lock():
            entry["blob"] = self.store.blobs.put(self.temp_path, hex_digest)
            if signature is not None:
                write_sidecar(self.store.blobs.path(entry["blob"]), signature)
            return self.store._set_entry(self.folder, self.name, self.variant, entry)

    def link(self, stored: StoredModel, source: dict[str, Any]) -> StoredModel:
        """Points this name at the file `stored` already has (same bytes, no copy), recording `source`
        and how the file's tensors came to be (the same bytes: `stored`'s)."""
        if "tensors" in stored.source:
            source = {**source, "tensors": stored.source["tensors"]}
        return self.store._link(self.folder, self.name, self.variant, stored, source)


class Store:
    """The local model store rooted at `root` (default `$BASE_HOME`)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else base_home()
        self.models_dir = self.root / "models"
        self.downloads_dir = self.root / "downloads"
        self.blobs = Blobs(self.root / "blobs")

    # -- reading

    def list(self) -> list[StoredModel]:
        """Every complete stored variant, sorted by reference."""
        models = []
        for manifest_path in sorted(self.models_dir.glob(f"*/*/{MANIFEST}")):
            manifest = _read_manifest(manifest_path.parent)
            if not manifest:
                continue
            for variant, entry in manifest.get("variants", {}).items():
                model = self._model(manifest["name"], variant, manifest_path.parent, entry)
                if model is not None:
                    models.append(model)
        return sorted(models, key=lambda m: m.ref.casefold())

    def get(self, name: str, variant: str) -> StoredModel | None:
        """The stored variant `name:variant` (exact org/name), or None."""
        org, short = check_model_name(name)
        folder = self.models_dir / org / short
        manifest = _read_manifest(folder)
        entry = manifest and manifest.get("variants", {}).get(variant)
        return self._model(manifest["name"], variant, folder, entry) if entry else None

    def resolve(self, ref: str) -> StoredModel:
        """The stored model a reference names: `org/name[:variant]` or `name[:variant]`, any case."""
        head, variant = split_ref(ref)
        models = self.list()
        key = head.casefold()
        matches = [m for m in models if (m.name if "/" in head else m.short_name).casefold() == key]
        same_name = matches
        if variant is not None:
            matches = [m for m in matches if m.variant.casefold() == variant.casefold()]
        if len(matches) == 1:
            return matches[0]
        if matches:
            refs = ", ".join(m.ref for m in matches)
            raise AmbiguousModelError(f"{ref!r} matches several stored models: {refs}; name one of them")
        if same_name:
            refs = ", ".join(m.ref for m in same_name)
            raise UnknownModelError(f"{head} has no variant {variant!r}; stored: {refs}")
        raise UnknownModelError(self._unknown_message(ref, models))

    @staticmethod
    def _unknown_message(ref: str, models: list[StoredModel]) -> str:
        labels: dict[str, tuple[str, str]] = {}  # casefolded label -> (label, model ref)
        for m in models:
            for label in (m.ref, m.name, m.short_name):
                labels.setdefault(label.casefold(), (label, m.ref))
        suggestions: dict[str, str] = {}  # model ref -> its closest label, one per model
        for key in difflib.get_close_matches(ref.casefold(), list(labels), n=10, cutoff=0.6):
            label, model_ref = labels[key]
            suggestions.setdefault(model_ref, label)
        if suggestions:
            return f"no stored model named {ref!r}; did you mean {' or '.join(list(suggestions.values())[:3])}?"
        return f"no stored model named {ref!r}; `base list` shows the stored models, `base pull org/name` adds one"

    # -- writing

    @contextmanager
    def lock(self, name: str, on_wait: Callable[[], None] | None = None) -> Iterator[Path]:
        """Holds the model's writer lock (flock on its `.lock`); yields the model folder."""
        org, short = check_model_name(name)
        folder = self.models_dir / org / short
        while True:
            folder.mkdir(parents=True, exist_ok=True)
            lock_file = open(folder / LOCK, "a+b")
            try:
                _flock(lock_file, on_wait)
                # `remove` may have deleted the folder while we waited: then lock the new one.
                if _same_file(lock_file, folder / LOCK):
                    break
            except BaseException:
                lock_file.close()
                raise
            lock_file.close()
        try:
            yield folder
        finally:
            lock_file.close()  # closing releases the flock

    @contextmanager
    def begin_write(self, name: str, variant: str, on_wait: Callable[[], None] | None = None) -> Iterator[PendingWrite]:
        """Writes one variant under the model's lock; nothing is published unless `commit` or `link` is called.

        On leaving, an uncommitted temp file is removed; a full disk becomes a NoSpaceError.
        """
        check_variant(variant)
        with self.lock(name, on_wait) as folder:
            with self.blobs.lock():  # a manifest of this folder may be being rewritten by another model's copy
                _remove_leftovers(folder)
            temp = folder / f".{variant}.{os.getpid()}.partial.base"
            pending = PendingWrite(self, name, variant, folder, temp, self.get(name, variant))
            try:
                yield pending
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise _no_space(folder) from None
                raise
            finally:
                temp.unlink(missing_ok=True)

    def add(
        self, name: str, variant: str, file: Path, *, arch: str, params: int, quant: str, source: dict[str, Any]
    ) -> StoredModel:
        """Copies a finished `.base` file into the store as `name:variant`."""
        with self.begin_write(name, variant) as pending:
            shutil.copyfile(file, pending.temp_path)
            return pending.commit(arch=arch, params=params, quant=quant, source=source)

    def copy(self, source_ref: str, destination: str, replace: bool = True) -> StoredModel:
        """Gives the stored model `source_ref` a second name, `org/name[:variant]` (`name` alone goes
        under `local/`; the variant defaults to the source's). No bytes are copied: both names point
        at one file. A destination that names another file is pointed at the source's, as Ollama's
        copy does, unless `replace` is False: then that is refused."""
        source = self.resolve(source_ref)
        head, variant = split_ref(destination)
        name, variant = qualify_name(head), check_variant(variant or source.variant)
        if (name.casefold(), variant.casefold()) == (source.name.casefold(), source.variant.casefold()):
            raise StoreError(f"{destination!r} is {source.ref} itself; give another name")
        with self.lock(name) as folder:
            existing = self.get(name, variant)
            if not replace and existing is not None and existing.path != source.path:
                raise StoreError(
                    f"{existing.ref} already names another model (from {existing.source.get('path') or 'elsewhere'}); "
                    "pass --force to point it at " + source.ref
                )
            return self._link(folder, name, variant, source, source.source)

    def remove(self, ref: str) -> StoredModel:
        """Removes one name (its manifest entry), then its file when no other name points at it."""
        from baselm.store.signing import sidecar  # as in `commit`

        model = self.resolve(ref)
        with self.lock(model.name) as folder, self.blobs.lock():
            manifest = _read_manifest(folder)
            if manifest and model.variant in manifest["variants"]:
                entry = manifest["variants"].pop(model.variant)
                if manifest["variants"]:
                    _write_json_atomic(folder / MANIFEST, manifest)
                else:
                    (folder / MANIFEST).unlink()
                if not entry.get("blob"):  # the older layout: the file is this name's alone
                    model.path.unlink(missing_ok=True)
                    sidecar(model.path).unlink(missing_ok=True)
            self.blobs.sweep(self._referenced_blobs())
            _remove_leftovers(folder)
            _remove_if_empty(folder, self.models_dir)
        return model

    def find_source(self, sha256: str, variant: str) -> StoredModel | None:
        """A stored model made from the source file of this sha256 as this variant, if any (its bytes
        are what converting that source again would give)."""
        return next((m for m in self.list() if m.variant == variant and m.source.get("sha256") == sha256), None)

    # -- manifests and blobs (NOTE: the methods below run under `self.blobs.lock()`)

    def _link(self, folder: Path, name: str, variant: str, stored: StoredModel, source: dict[str, Any]) -> StoredModel:
        with self.blobs.lock():
            current = self.get(stored.name, stored.variant)  # it may have been removed or replaced meanwhile
            if current is None or (stored.digest and current.digest != stored.digest):
                raise UnknownModelError(f"{stored.ref} was removed or replaced while being named; try again")
            entry = {"arch": current.arch, "params": current.params, "size": current.size, "quant": current.quant}
            entry.update(source=source, pulled=_now(), blob=self._ensure_blob(current))
            return self._set_entry(folder, name, variant, entry)

    def _ensure_blob(self, model: StoredModel) -> str:
        """The blob id of a stored model; a file of the older layout is moved into blobs/ first."""
        from baselm.store.signing import sidecar

        if model.digest:
            return model.digest.replace(":", "-", 1)
        folder = model.path.parent
        blob = self.blobs.put(model.path, file_sha256(model.path))
        if sidecar(model.path).is_file():
            publish(sidecar(model.path), sidecar(self.blobs.path(blob)))
        manifest = _read_manifest(folder)
        if manifest and model.variant in manifest["variants"]:
            manifest["variants"][model.variant]["blob"] = blob
            _write_json_atomic(folder / MANIFEST, manifest)
        return blob

    def _set_entry(self, folder: Path, name: str, variant: str, entry: dict[str, Any]) -> StoredModel:
        """Writes `entry` as `name:variant`, then removes what nothing points at any more."""
        from baselm.store.signing import sidecar

        manifest = _read_manifest(folder) or {"name": name, "variants": {}}
        old = manifest["variants"].get(variant)
        if old and not old.get("blob"):  # the older layout's file, replaced
            (folder / f"{variant}.base").unlink(missing_ok=True)
            sidecar(folder / f"{variant}.base").unlink(missing_ok=True)
        manifest["variants"][variant] = entry
        manifest["schema"] = MANIFEST_SCHEMA
        _write_json_atomic(folder / MANIFEST, manifest)
        self.blobs.sweep(self._referenced_blobs())
        model = self._model(name, variant, folder, entry)
        if model is None:
            raise StoreError(f"the file of {name}:{variant} changed while it was being stored; pull it again")
        return model

    def _referenced_blobs(self) -> set[str]:
        blobs = set()
        for manifest_path in self.models_dir.glob(f"*/*/{MANIFEST}"):
            manifest = _read_manifest(manifest_path.parent) or {"variants": {}}
            blobs.update(e.get("blob") for e in manifest["variants"].values() if isinstance(e, dict))
        return blobs - {None}

    def _model(self, name: str, variant: str, folder: Path, entry: dict[str, Any]) -> StoredModel | None:
        """The stored model of a manifest entry, or None when its file is absent or has another size."""
        try:
            blob = entry.get("blob")
            path = self.blobs.path(str(blob)) if blob else folder / f"{variant}.base"
            if path.stat().st_size != entry["size"]:
                return None
            return StoredModel(
                name=name,
                variant=variant,
                path=path,
                arch=str(entry["arch"]),
                params=int(entry["params"]),
                size=int(entry["size"]),
                quant=str(entry["quant"]),
                source=dict(entry.get("source") or {}),
                pulled=str(entry.get("pulled", "")),
                digest=blob_digest(str(blob or "")),
            )
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            return None

    def check_free_space(self, num_bytes: int) -> None:
        """Raises NoSpaceError when the store's disk has less than `num_bytes` free."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < num_bytes:
            raise NoSpaceError(
                f"not enough disk space in {self.root}: need {num_bytes / 2**30:.2f} GiB, "
                f"{free / 2**30:.2f} GiB free; free some space or set BASE_HOME to another disk"
            )


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent, or damaged by something other than our atomic writes: not listed
    ok = isinstance(manifest, dict) and isinstance(manifest.get("variants"), dict) and "name" in manifest
    return manifest if ok else None


def _remove_leftovers(folder: Path) -> None:
    """Deletes temp files of killed writers. NOTE: call only while holding the model's lock."""
    for path in folder.iterdir():
        if path.name.startswith(".") and path.name != LOCK and path.is_file():
            path.unlink(missing_ok=True)


def _remove_if_empty(folder: Path, stop: Path) -> None:
    """Removes a model folder left with only its lock, then an empty org folder.

    NOTE: call while holding the lock; waiters notice the deleted lock file and lock afresh.
    """
    if all(p.name == LOCK for p in folder.iterdir()):
        shutil.rmtree(folder, ignore_errors=True)
        try:
            if folder.parent != stop:
                folder.parent.rmdir()
        except OSError:
            pass  # the org folder holds other models


def _flock(lock_file: Any, on_wait: Callable[[], None] | None) -> None:
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if on_wait is not None:
            on_wait()
        fcntl.flock(lock_file, fcntl.LOCK_EX)


def _same_file(handle: Any, path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def model_entry(model: StoredModel) -> dict[str, Any]:
    """A stored model as plain JSON data (for `base list --json`)."""
    data = asdict(model)
    data["path"] = str(model.path)
    data["ref"] = model.ref
    return data
