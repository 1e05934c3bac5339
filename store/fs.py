"""Files on disk: writes that a crash cannot leave half-done, and sizes as people read them.

NOTE: every file the store publishes is written under a dot-name in its final folder (so
listings skip it and the next writer of that folder may remove it), fsynced, renamed over the
final name, and the folder is fsynced: after a crash the final name holds either the old file
or the complete new one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_write(path: Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """A temp file beside `path`, opened in `mode`; published as `path` when the block ends
    without an error, removed when it raises."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
        publish(Path(temp), path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def publish(temp: Path, path: Path) -> None:
    """Moves a finished `temp` file to `path` durably: fsync the file, rename, fsync the folder."""
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Makes a rename inside `folder` durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def human_size(num_bytes: float) -> str:
    """`512 B`, `1.5 KiB`, `98.4 MiB`, `2.1 GiB`."""
    if num_bytes < 1024:
        return f"{int(num_bytes)} B"
    for unit in ("KiB", "MiB", "GiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GiB":
            break
    return f"{num_bytes:.1f} {unit}"
