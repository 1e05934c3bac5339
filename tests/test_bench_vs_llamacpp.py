"""tests/tools/bench_vs_llamacpp.py's readers: llama-batched-bench's table, and the files it can name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.bench_vs_llamacpp import BenchError, parse_batched_bench, render, resolve_names

# As llama-batched-bench prints it (its log lines go to stderr; the table to stdout).
TABLE = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.412 |   310.68 |    1.901 |    33.67 |    2.313 |    83.01 |
|   128 |     64 |    8 |   1536 |    3.377 |   303.23 |    6.012 |    85.16 |    9.389 |   163.59 |
"""


def test_the_batched_bench_table_reads_as_rows_by_stream_count():
    rows = parse_batched_bench(TABLE)
    assert sorted(rows) == [1, 8]
    assert rows[1]["S_TG t/s"] == 33.67
    assert rows[8]["S_TG t/s"] == 85.16
    assert rows[8]["N_KV"] == 1536


def test_an_unknown_file_name_is_one_clear_error(tmp_path: Path):
    with pytest.raises(BenchError, match="unknown file 'nope'.*smollm2"):
        resolve_names(["nope"], tmp_path)


def test_the_table_gives_base_over_llama_cpp_and_flags_an_isa_not_asked_for():
    llama = {"tg64": 40.0, "tg8": 80.0, "pp128": 300.0}
    run = {"requested_isa": "avx512", "isa": "avx2", "tg1": 50.0, "tg8": 100.0, "pp128": 150.0}
    entry = {"name": "0.5b-q4_k_m", "quant": "Q4_K_M", "llama_cpp": llama, "base": [run]}
    lines = render({"llama_cpp": "0.3.36", "files": [entry]}).splitlines()
    assert lines[2].split() == "0.5b-q4_k_m Q4_K_M avx2(!) 40.0 50.0 1.25 80.0 100.0 1.25 300.0 150.0 0.50".split()
    assert lines[-1].startswith("(!)")
