"""The local model store: `.base` files under `$BASE_HOME/models`, addressed as `org/name[:variant]`.

Layout (one folder per model, one file per variant):

    $BASE_HOME/models/<org>/<name>/
        <variant>.base     a complete model file (variant: a quant scheme or profile, e.g. q4)
        manifest.json      {"schema": 1, "name": "org/name", "variants": {variant: entry}}
        .lock              flock'd by whoever writes or removes this model
        .<anything>        a write in progress (temp .base files, temp manifests)

A model is addressed by `org/name:variant`; `org/name` alone works when it has one variant;
`name` alone (any letter case, e.g. `smollm2-135m-instruct`) works when one stored model has
that name. An ambiguous reference is an error that lists the candidates: the store never
guesses between variants.

NOTE: crash safety. A variant is in the manifest only after its `.base` file is complete:
the file is written under a dot-name, fsynced, renamed to `<variant>.base`, the folder is
fsynced, and only then is the manifest rewritten (temp, fsync, rename). `list` and `resolve`
read manifests only and skip entries whose file is absent or has another size, so a kill at
any point leaves nothing half-made visible. Dot-files left by a killed writer are removed by
the next writer of that model, which holds the model's lock (so no live writer owns them).
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

from baselm.store.default_model import base_home
from baselm.store.errors import StoreError
from baselm.store.fs import atomic_write, publish

MANIFEST = "manifest.json"
LOCK = ".lock"
MANIFEST_SCHEMA = 1
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
    """A variant being written: fill `temp_path`, then `commit` to publish it."""

    store: Store
    name: str
    variant: str
    folder: Path
    temp_path: Path  # write the .base file here (a dot-name: invisible to list, removed if abandoned)
    existing: StoredModel | None  # what the store holds for this variant now, if anything

    @property
    def final_path(self) -> Path:
        return self.folder / f"{self.variant}.base"

    def commit(
        self, *, arch: str, params: int, quant: str, source: dict[str, Any], signature: dict[str, Any] | None = None
    ) -> StoredModel:
        """Moves the finished file into place, then records it in the manifest (in that order).

        `signature`: a checked detached signature that came with the file, stored beside it; without
        one, a signature left beside an earlier file of this variant is removed."""
        from baselm.store.signing import sidecar, write_sidecar  # cryptography (~9 MiB): not on every command

        if not self.temp_path.is_file():
            raise StoreError(f"nothing was written to {self.temp_path}; the model was not stored")
        sidecar(self.final_path).unlink(missing_ok=True)
        publish(self.temp_path, self.final_path)
        if signature is not None:
            write_sidecar(self.final_path, signature)
        entry = {
            "arch": arch,
            "params": int(params),
            "size": self.final_path.stat().st_size,
            "quant": quant,
            "source": source,
            "pulled": _now(),
        }
        manifest = _read_manifest(self.folder) or {"schema": MANIFEST_SCHEMA, "name": self.name, "variants": {}}
        manifest["variants"][self.variant] = entry
        _write_json_atomic(self.folder / MANIFEST, manifest)
        model = _entry_model(self.name, self.variant, self.folder, entry)
        if model is None:
            raise StoreError(f"{self.final_path} changed while it was being stored; pull it again")
        return model


class Store:
    """The local model store rooted at `root` (default `$BASE_HOME`)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else base_home()
        self.models_dir = self.root / "models"
        self.downloads_dir = self.root / "downloads"

    # -- reading

    def list(self) -> list[StoredModel]:
        """Every complete stored variant, sorted by reference."""
        models = []
        for manifest_path in sorted(self.models_dir.glob(f"*/*/{MANIFEST}")):
            manifest = _read_manifest(manifest_path.parent)
            if not manifest:
                continue
            for variant, entry in manifest.get("variants", {}).items():
                model = _entry_model(manifest["name"], variant, manifest_path.parent, entry)
                if model is not None:
                    models.append(model)
        return sorted(models, key=lambda m: m.ref.casefold())

    def get(self, name: str, variant: str) -> StoredModel | None:
        """The stored variant `name:variant` (exact org/name), or None."""
        org, short = check_model_name(name)
        folder = self.models_dir / org / short
        manifest = _read_manifest(folder)
        entry = manifest and manifest.get("variants", {}).get(variant)
        return _entry_model(manifest["name"], variant, folder, entry) if entry else None

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
        """Writes one variant under the model's lock; nothing is published unless `commit` is called.

        On leaving, an uncommitted temp file is removed; a full disk becomes a NoSpaceError.
        """
        check_variant(variant)
        with self.lock(name, on_wait) as folder:
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

    def remove(self, ref: str) -> StoredModel:
        """Removes one stored variant (the manifest entry first, then its file)."""
        from baselm.store.signing import sidecar  # as in `commit`

        model = self.resolve(ref)
        with self.lock(model.name) as folder:
            manifest = _read_manifest(folder)
            if manifest and model.variant in manifest["variants"]:
                del manifest["variants"][model.variant]
                if manifest["variants"]:
                    _write_json_atomic(folder / MANIFEST, manifest)
                else:
                    (folder / MANIFEST).unlink()
            model.path.unlink(missing_ok=True)
            sidecar(model.path).unlink(missing_ok=True)
            _remove_leftovers(folder)
            _remove_if_empty(folder, self.models_dir)
        return model

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


def _entry_model(name: str, variant: str, folder: Path, entry: dict[str, Any]) -> StoredModel | None:
    path = folder / f"{variant}.base"
    try:
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
        )
    except (OSError, KeyError, TypeError, ValueError):
        return None


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
