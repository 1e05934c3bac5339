"""`base doctor` and `base bench` say which matmul path runs on the CPU, kernels on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from baselm import cpu
from baselm.backend import select_backend
from tests.test_cli import base
from tests.tiny_model import write_model_folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("tiny"))


def test_reference_path_when_kernels_are_off():
    backend = select_backend("cpu")
    assert backend.cpu_kernels == backend.keep_quantized == cpu.available()
    report = json.loads(base("doctor", "--json", env={**os.environ, "BASE_CPU_KERNELS": "0"}).stdout)
    assert report["cpu_kernels"] == {
        "loaded": False,
        "isa": None,
        "threads": None,
        "reason": "disabled by BASE_CPU_KERNELS=0",
    }
    assert report["compute"].startswith("float32 (quantized weights dequantized at load)")


def test_doctor_names_the_kernels_when_loaded():
    if not cpu.available():
        pytest.skip(f"CPU kernels not loaded: {cpu.status['reason']}")
    report = json.loads(base("doctor", "--json").stdout)
    assert report["cpu_kernels"]["loaded"] is True
    assert report["cpu_kernels"]["isa"] in cpu.kernels.supported_isas()
    assert report["compute"].startswith("base CPU kernels (")


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_bench_json_says_which_matmuls_ran(model_folder, kernels):
    env = {**os.environ, "BASE_CPU_KERNELS": kernels}
    args = ("bench", str(model_folder), "--prompt-tokens", "8", "--gen-tokens", "3", "--concurrency", "1")
    result = base(*args, "--json", "--device", "cpu", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    loaded = subprocess.run(
        [sys.executable, "-c", "from baselm import cpu; print(cpu.available())"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if loaded == "True":
        assert report["matmuls"].startswith("base CPU kernels (")
    else:
        assert report["matmuls"].startswith("MLX CPU ops, weights widened to float32 (")
    assert report["throughput"][0]["decode_tok_s_per_stream"] > 0


def test_bench_needs_a_model_or_synthetic_sizes():
    result = base("bench")
    assert result.returncode == 1 and "--synthetic" in result.stderr and "Traceback" not in result.stderr
    result = base("bench", "--synthetic", "2B")
    assert result.returncode == 1 and "unknown synthetic size '2B'" in result.stderr
