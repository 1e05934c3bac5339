"""Content-addressed model files: each stored `.base` file once, under the sha256 of its bytes.

Layout:

    $BASE_HOME/blobs/
        sha256-<hex>.base      a complete model file, named by the digest of its bytes
        sha256-<hex>.base.sig  its detached signature, when it came with one
        .lock                  flock'd while a blob or any manifest changes (held for moments)

Names live in the manifests (see `registry.py`); several names may point at one blob, and a
blob is removed when no manifest points at it any more.

Why sha256 and not xxhash (already used for per-tensor checksums): a digest here is an
identity, and two files with one digest are taken to be the same model. sha256 makes a
forged collision infeasible, it is the digest the hub lists for LFS files and the one local
imports already record, and Ollama's clients read digests as `sha256:<hex>`. Its cost, one
read of the finished file, is measured in `docs/model-files.md`.

NOTE: lock order. A writer takes its model's lock first, then this lock, never the other way
round; this lock is held only while manifests and blobs are renamed, never while converting.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from baselm.store.fs import publish

BLOB_LOCK = ".lock"
_PREFIX = "sha256-"
_SUFFIX = ".base"
_SIG_SUFFIX = ".sig"  # as signing.SIG_SUFFIX; not imported, since signing pulls in cryptography


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


class Blobs:
    """The folder of content-addressed files under `root` (`$BASE_HOME/blobs`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, blob: str) -> Path:
        """The file of a blob id (`sha256-<hex>`)."""
        return self.root / f"{blob}{_SUFFIX}"

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Holds the store-wide lock under which blobs and manifests change."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / BLOB_LOCK, "a+b") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            yield  # closing the file releases the flock

    def put(self, file: Path, hex_digest: str) -> str:
        """Moves `file` (whose sha256 is `hex_digest`) in as a blob; the same bytes stored already
        are kept and `file` is removed. Returns the blob id. NOTE: call while holding `lock`."""
        blob = f"{_PREFIX}{hex_digest}"
        target = self.path(blob)
        if target.is_file() and target.stat().st_size == file.stat().st_size:
            file.unlink()
        else:
            publish(file, target)
        return blob

    def sweep(self, referenced: Iterable[str]) -> list[str]:
        """Removes every blob no manifest points at, with its signature, and temp files of killed
        writers; returns the blob ids removed. NOTE: call while holding `lock`, with `referenced`
        read under it."""
        keep = set(referenced)
        removed = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if path.name.startswith(".") and path.name != BLOB_LOCK:
                path.unlink(missing_ok=True)  # every write here is made under the lock: its writer is dead
            elif path.name.startswith(_PREFIX) and path.name.endswith(_SUFFIX):
                blob = path.name.removesuffix(_SUFFIX)
                if blob not in keep:
                    path.unlink(missing_ok=True)
                    path.with_name(path.name + _SIG_SUFFIX).unlink(missing_ok=True)
                    removed.append(blob)
        return removed


def blob_digest(blob: str) -> str:
    """A blob id as Ollama writes a digest: `sha256-<hex>` -> `sha256:<hex>` ("" for none)."""
    return blob.replace("-", ":", 1) if blob else ""
