"""llama.cpp's real vocabulary files, golden tokenizer outputs and chat templates, for tests.

They ship inside `llama-cpp-python`'s PyPI sdist (`vendor/llama.cpp/models/`): the sdist is
fetched once with pip (never installed) and only that folder's `ggml-vocab-*` files and
`templates/*.jinja` are extracted, under base's cache folder like the SmolLM2 GGUF.
`$BASE_LLAMA_CPP_MODELS` names an already extracted `models/` folder instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

from baselm.store.default_model import base_home

SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
_MEMBER_ROOT = "vendor/llama.cpp/models/"


def models_dir_path() -> Path:
    """Where the extracted `models/` folder lives (whether or not it is there yet)."""
    override = os.environ.get("BASE_LLAMA_CPP_MODELS")
    if override:
        return Path(override)
    return base_home() / "downloads" / SDIST_REQUIREMENT.replace("==", "-") / "models"


@lru_cache(maxsize=1)
def fetch_models_dir() -> tuple[Path | None, str]:
    """(the extracted `models/` folder, "") or (None, why it could not be had)."""
    target = models_dir_path()
    if (target / "templates").is_dir():
        return target, ""
    if os.environ.get("BASE_LLAMA_CPP_MODELS"):
        return None, f"$BASE_LLAMA_CPP_MODELS={target} has no templates/ folder"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp]
        try:
            result = subprocess.run([*cmd, SDIST_REQUIREMENT], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"could not run pip to fetch {SDIST_REQUIREMENT}: {exc}"
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or not sdists:
            return None, f"pip could not fetch {SDIST_REQUIREMENT}: {result.stderr.strip()[-300:]}"
        staged = Path(tmp) / "models"
        _extract_models(sdists[0], staged)
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)  # whole or not at all: a half-extracted folder never carries the name
    return target, ""


def _extract_models(sdist: Path, out: Path) -> None:
    """The sdist's vocabulary files and templates, flattened into `out` and `out/templates`."""
    (out / "templates").mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, inner = member.name.partition("/")
            if not member.isfile() or not inner.startswith(_MEMBER_ROOT):
                continue
            rel = inner[len(_MEMBER_ROOT) :]
            if rel.startswith("ggml-vocab-") and "/" not in rel:
                dest = out / rel
            elif rel.startswith("templates/") and rel.endswith(".jinja") and rel.count("/") == 1:
                dest = out / rel
            else:
                continue
            with tar.extractfile(member) as src, dest.open("wb") as dst:
                shutil.copyfileobj(src, dst)
