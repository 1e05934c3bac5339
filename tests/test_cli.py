"""The `base` command as a person runs it: a real subprocess, its output and exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pexpect
import pytest

from tests.tiny_model import write_model_folder

COMMANDS = [
    "pull",
    "list",
    "show",
    "ps",
    "rm",
    "cp",
    "inspect",
    "doctor",
    "run",
    "chat",
    "bench",
    "serve",
    "perplexity",
]


def base(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "baselm.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("tiny"))


def test_help_lists_every_command():
    result = base("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert f" {command} " in result.stdout


def test_version_prints_the_installed_packages_version():
    from importlib.metadata import version

    for flag in ("--version", "-v"):
        result = base(flag)
        assert result.returncode == 0 and result.stdout == f"base {version('baselm')}\n"


def test_help_shows_flags_without_a_value():
    from typer.testing import CliRunner

    from baselm.cli import app

    runner = CliRunner()
    for command in [*COMMANDS, "keygen", "sign", "verify"]:
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, f"base {command} --help:\n{result.output}"
    run_help = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert re.search(r"--json\s+Print one JSON object", run_help)


def test_serve_help_names_every_api_and_groups_its_options():
    from typer.testing import CliRunner

    from baselm.cli import app

    text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "OpenAI (/v1), Anthropic (/v1/messages) and Ollama (/api) APIs" in text
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels == ["Arguments", "Options", "Sampling defaults", "Performance", "Limits", "Distributed", "Security"]
    security = text[text.index("╭─ Security") :]
    assert "--api-key " in security and "--allowed-hosts" in security and "--cors-origins" in security


def test_help_does_not_import_mlx():
    code = "import sys; from baselm.cli import app; print('mlx.core' in sys.modules)"
    # baselm/__init__ loads the BLAS only; the CLI module itself must not pull in MLX.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_doctor_json_reports_the_backend_and_blas(tmp_path):
    report = json.loads(base("doctor", "--json", env={**os.environ, "BASE_HOME": str(tmp_path)}).stdout)
    assert report["backend"] in ("cpu", "metal", "cuda")
    assert {"python", "mlx", "blas", "kernels", "store", "warnings"} <= set(report)
    assert report["speed"]["read_gb_s"] > 0 and report["speed"]["decode"] is None  # no default model stored


def test_doctor_decodes_the_default_model_when_it_is_stored(tmp_path):
    from baselm.store.default_model import STORE_NAME
    from tests.tiny_gguf import tiny_llama_gguf

    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    gguf_path, _ = tiny_llama_gguf(tmp_path / "tiny.gguf", "Q4_1")
    assert base("pull", str(gguf_path), "--name", STORE_NAME, "--quiet", env=env).returncode == 0
    result = base("doctor", env=env)
    speed = result.stdout[result.stdout.index("Speed") :]
    assert re.match(rf"Speed\s+{STORE_NAME}:q4_1: decode [\d.]+ tok/s, prefill \d+ tok/s \(1 stream, 32 tokens", speed)
    assert "memory reads" in speed and "tok/s for 1 GiB" in speed
    assert base("doctor", "--no-speed", env=env).stdout.count("not measured (--no-speed)") == 1


def test_doctor_says_why_the_cpu_kernels_are_off_once():
    from tests.cpu.test_warning import CLI_WITHOUT_KERNELS, REASON

    result = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_KERNELS, REASON, "doctor", "--no-speed"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(REASON) == 1
    assert f"warning: CPU kernels not loaded ({REASON})" in result.stdout
    assert "cpu decoder layer (steps of up to 32 tokens): off (see Compute)" in result.stdout


def test_run_json_returns_text_ids_logprobs_usage_and_timings(model_folder):
    result = base(
        "run", str(model_folder), "Hello there", "--json", "--max-tokens", "5", "--logprobs", "2", "--device", "cpu"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) == len(out["logprobs"]) <= 5
    assert out["usage"] == {
        "prompt_tokens": len(out["prompt_token_ids"]),
        "completion_tokens": len(out["token_ids"]),
        "total_tokens": len(out["prompt_token_ids"]) + len(out["token_ids"]),
    }
    assert out["finish_reason"] in ("stop", "length")
    assert all(len(entry["top_logprobs"]) == 2 for entry in out["logprobs"])
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s"} <= set(out["timings"])


def test_run_samples_with_the_generation_defaults_and_a_seed_repeats_it(model_folder):
    args = ("run", str(model_folder), "Hello there", "--json", "-n", "8", "--device", "cpu")
    first, again = (json.loads(base(*args, "--seed", "3").stdout)["token_ids"] for _ in range(2))
    assert first == again and 1 <= len(first) <= 8


def test_raw_prompt_skips_the_chat_template(model_folder):
    templated = json.loads(base("run", str(model_folder), "Hi", "--json", "-n", "1", "--device", "cpu").stdout)
    raw = json.loads(base("run", str(model_folder), "Hi", "--json", "-n", "1", "--raw", "--device", "cpu").stdout)
    assert len(raw["prompt_token_ids"]) < len(templated["prompt_token_ids"])


def test_a_missing_model_is_one_clear_line_and_exit_1(tmp_path):
    result = base("run", str(tmp_path / "nope.gguf"), "hi", env={"BASE_HOME": str(tmp_path), "PATH": ""})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr and "nope.gguf" in result.stderr


def test_bad_sampling_values_are_refused_clearly(model_folder):
    result = base("run", str(model_folder), "hi", "--top-p", "1.5", "--device", "cpu")
    assert result.returncode == 1 and "top_p" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_run_answers_the_capital_of_france(smollm2_gguf):
    result = base("run", str(smollm2_gguf), "What is the capital of France?", "-n", "24", "-t", "0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr


LONG_NAMES = ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"]


@pytest.fixture
def store_with_long_names(tmp_path):
    from baselm.store.registry import Store

    store = Store(tmp_path)
    for name in LONG_NAMES:
        with store.begin_write(name, "q4_1") as pending:
            pending.temp_path.write_bytes(b"x" * 100)
            pending.commit(arch="llama", params=135_000_000, quant="q4", source={"format": "gguf", "path": "/m/x.gguf"})
    return {**os.environ, "BASE_HOME": str(tmp_path)}


def test_list_into_a_pipe_shows_whole_names_and_every_column(store_with_long_names):
    result = base("list", env={**store_with_long_names, "COLUMNS": "80"})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    for name in LONG_NAMES:
        assert any(name in line and "/m/x.gguf" in line for line in lines), result.stdout
    assert any(line.startswith("variant: the name's :tag, the source's own quantization") for line in lines)
    assert "quant: the bits most weights are stored with here (base show NAME has the rest)" in lines
    assert [m["name"] for m in json.loads(base("list", "--json", env=store_with_long_names).stdout)] == LONG_NAMES


def test_list_on_an_80_column_terminal_keeps_whole_names(store_with_long_names):
    env = {k: v for k, v in store_with_long_names.items() if k not in ("COLUMNS", "LINES")}
    child = pexpect.spawn(
        sys.executable, ["-m", "baselm.cli", "list"], env=env, dimensions=(24, 80), encoding="utf-8", timeout=60
    )
    child.expect(pexpect.EOF)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", child.before).splitlines()  # without colours
    assert max(len(line.rstrip()) for line in lines) <= 80
    for name in LONG_NAMES:
        assert any(name in line for line in lines), child.before


def test_bench_tables_fit_an_80_column_terminal_without_cutting_a_word(model_folder):
    args = ["-m", "baselm.cli", "bench", str(model_folder), "--concurrency", "1,2", "--prompt-tokens", "8"]
    args += ["--gen-tokens", "4", "--speculative", "ngram", "--spec-repeats", "1", "--device", "cpu"]
    child = pexpect.spawn(sys.executable, args, dimensions=(40, 80), encoding="utf-8", timeout=300)
    child.expect(pexpect.EOF)
    text = re.sub(r"\x1b\[[0-9;]*m", "", child.before)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "…" not in text, text
    for title in ("throughput and latency", "ms per step", "with and without speculative decoding"):
        assert title in text
    assert "decode tok/s" in text and "per stream" in text and "overhead" in text


def test_cp_adds_a_name_and_rm_frees_the_file_only_with_the_last_name(store_with_long_names, tmp_path):
    env = store_with_long_names
    copied = base("cp", "smollm2-135m-instruct", "mine", env=env)
    assert (copied.returncode, copied.stdout) == (
        0,
        "copied HuggingFaceTB/SmolLM2-135M-Instruct:q4_1 to local/mine:q4_1\n",
    )
    listed = {m["ref"]: m for m in json.loads(base("list", "--json", env=env).stdout)}
    assert listed["local/mine:q4_1"]["path"] == listed["HuggingFaceTB/SmolLM2-135M-Instruct:q4_1"]["path"]
    # the fixture stored the same 100 bytes under both long names: one file, three names now
    first = base("rm", "HuggingFaceTB/SmolLM2-135M-Instruct", env=env)
    assert first.stdout.startswith("removed HuggingFaceTB/SmolLM2-135M-Instruct:q4_1 (its file stays, for local/mine")
    assert base("rm", "mine", env=env).stdout == f"removed local/mine:q4_1 (its file stays, for {LONG_NAMES[1]}:q4_1)\n"
    assert base("rm", LONG_NAMES[1], env=env).stdout == f"removed {LONG_NAMES[1]}:q4_1 (freed 100 B)\n"
    assert [p.name for p in (tmp_path / "blobs").iterdir()] == [".lock"]
    missing = base("cp", "nothing", "x", env=env)
    assert missing.returncode == 1 and "no stored model named 'nothing'" in missing.stderr


def test_pull_reports_the_conversion_on_stderr_and_prints_only_the_name_on_stdout(tmp_path):
    from tests.tiny_gguf import tiny_llama_gguf

    path, _ = tiny_llama_gguf(tmp_path / "Tiny.Q8_0.gguf", "Q8_0")
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    result = base("pull", str(path), env=env)
    assert (result.returncode, result.stdout) == (0, "local/Tiny:q8_0\n"), result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "converting Tiny.Q8_0.gguf (21 tensors)"
    assert re.fullmatch(r"  converted Tiny\.Q8_0\.gguf: 21 tensors in \d+\.\d s", lines[-2]), lines
    assert re.fullmatch(
        r"stored local/Tiny:q8_0: .* KiB, .*M weights in q8 \(21 tensors: 16 kept exactly, 5 float\), "
        r".*/blobs/sha256-[0-9a-f]{64}\.base \(.*\)",
        lines[-1],
    )
    assert base("pull", str(path), "--quiet", env=env).stderr == ""


def test_pull_on_a_terminal_draws_a_bar_then_its_closing_line(tmp_path):
    from tests.tiny_gguf import tiny_llama_gguf

    path, _ = tiny_llama_gguf(tmp_path / "Tiny.Q8_0.gguf", "Q8_0")
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    child = pexpect.spawn(
        sys.executable, ["-m", "baselm.cli", "pull", str(path), "--quant", "q4"], env=env, encoding="utf-8", timeout=120
    )
    child.expect(pexpect.EOF)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before)
    assert "converted Tiny.Q8_0.gguf: 21 tensors in" in text and "stored local/Tiny:q4:" in text, text
    assert "downloading" not in text and "converting Tiny.Q8_0.gguf (21 tensors)" not in text  # a bar, not lines
