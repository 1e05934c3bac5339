"""The REPL as a person uses it: `base chat` driven through a pseudo-terminal (or a pipe), with
`--serve` answering HTTP on the same engine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pexpect

from tests.tiny_model import thinking_template, write_model_folder
from tests.vision_fixture import FOLDER, IMAGE_A, PROMPT_1, loaded_vlm, reference

BASE = shutil.which("base") or str(Path(sys.executable).parent / "base")
TIMEOUT_S = 60  # for any one expected output of the REPL: it only bounds a hang, so generous on a loaded machine


def _spawn(chat_model: Path, home: Path, *args: str) -> pexpect.spawn:
    env = {**os.environ, "BASE_HOME": str(home), "TERM": "xterm", "COLUMNS": "200", "LINES": "40"}
    child = pexpect.spawn(
        BASE,
        ["chat", str(chat_model), "--device", "cpu", "--seed", "0", *args],
        env=env,
        encoding="utf-8",
        timeout=TIMEOUT_S,
        dimensions=(40, 200),
        # A shell that runs the suite in the background hands its children SIGINT ignored, and
        # Python then leaves it ignored: Ctrl-C would do nothing. The chat gets it as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.expect_exact(">>> ")
    return child


def _ask(child: pexpect.spawn, line: str, *expected: str) -> None:
    """Sends a line and waits for each expected pattern (regex), then for the next prompt."""
    child.sendline(line)
    for pattern in expected:
        child.expect(pattern)
    child.expect_exact(">>> ")


def _leave(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def _quit(child: pexpect.spawn) -> int:
    """Sends /quit; returns the exit status."""
    child.sendline("/quit")
    return _leave(child)


def _stop_answer(child: pexpect.spawn) -> None:
    """Ctrl-C while an answer streams: the turn ends as stopped and the prompt comes back."""
    child.sendintr()
    child.expect("stopped")
    child.expect_exact(">>> ")


def test_repl_answers_and_runs_its_commands(chat_model, tmp_path):
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "8")
    try:
        _ask(child, "/help", "Multi-line input")
        _ask(child, "/system Be brief.", "system prompt set")
        _ask(child, "hello there", r"decode 8 tokens [\d.]+ tok/s · context \d+/4096")
        _ask(child, "/set temperature hot", "error: temperature takes a number, got 'hot'")
        _ask(
            child,
            "/set",
            "temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0, max_tokens=8, seed=0",
        )
        _ask(
            child,
            "/set top_p",
            r"error: usage: /set temperature\|top_p\|top_k\|min_p\|repetition_penalty\|max_tokens\|seed VALUE",
        )
        _ask(child, "/frobnicate", "unknown command /frobnicate; commands: /help")
        _ask(child, f"/save {tmp_path / 'one.json'}", "saved 2 messages")
        saved = json.loads((tmp_path / "one.json").read_text())
        assert saved["settings"] == {  # the generation defaults (llama.cpp's: the model has none), --max-tokens, --seed
            "temperature": 0.8,
            "top_p": 0.95,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.0,
            "max_tokens": 8,
            "seed": 0,
        }
        assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]
        assert saved["messages"][0]["content"] == "Be brief."
        assert saved["messages"][2]["content"]  # the random model's text came back
        _ask(child, "/clear", "conversation cleared")
        _ask(child, f"/save {tmp_path / 'empty.json'}", "saved 0 messages")
        _ask(child, f"/load {tmp_path / 'one.json'}", "loaded 2 messages")
        _ask(child, f"/save {tmp_path / 'two.json'}", "saved 2 messages")
        assert json.loads((tmp_path / "two.json").read_text())["messages"] == saved["messages"]
        _ask(child, "/stats", r"last turn: \d+ prompt tokens, 0 cached, 8 generated \(length\)", "session: 1 turn, ")
        _ask(child, "more", "decode 8 tokens")
        _ask(child, "/stats", "session: 2 turns, ")
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(chat_model, tmp_path):
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "3000")
    try:
        child.sendline("tell me a long story")
        child.expect(r"[1-9]\d* tokens · Ctrl-C stops")  # the answer is streaming
        _stop_answer(child)
        _ask(child, "/stats", r"generated \(abort\)")
        _ask(child, "/set max_tokens 4", "max_tokens=4")
        child.sendline("and now briefly")
        child.expect(r"\((\d+) cached\)")
        assert int(child.match.group(1)) > 0  # the stopped answer's blocks serve the next turn
        child.expect("decode 4 tokens")
        child.expect_exact(">>> ")
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_leaves(chat_model, tmp_path):
    home = tmp_path / "home"
    child = _spawn(chat_model, home, "--max-tokens", "4")
    try:
        child.send("this line is dropped")
        child.expect_exact("this line is dropped")  # echoed: readline has it and waits for more
        child.sendintr()
        child.expect_exact(">>> ")
        _ask(child, "/stats", "last turn: none yet", "session: 0 turns")
        child.sendeof()
        assert _leave(child) == 0
    finally:
        child.close(force=True)
    assert (home / "chat_history").read_text().splitlines()[-1] == "/stats"


def test_history_carries_over_to_the_next_session(chat_model, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "chat_history").write_text("/system From the last session.\n")
    child = _spawn(chat_model, home, "--max-tokens", "4")
    try:
        child.send("\x1b[A")  # arrow up recalls the last line of the previous session
        child.send("\r")
        child.expect("system prompt set")
        child.expect_exact(">>> ")
        _ask(child, "/system", "system prompt: 'From the last session.'")
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_answers_http_while_the_repl_streams_on_the_same_engine(chat_model, tmp_path):
    port = _free_port()
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "3000", "--serve", "--port", str(port))
    try:
        child.sendline("tell me a long story")
        child.expect(r"[1-9]\d* tokens · Ctrl-C stops")
        body = {"model": chat_model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 5
        assert answer["choices"][0]["finish_reason"] == "length"
        _stop_answer(child)  # the REPL's answer was still running alongside
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def test_piped_chat_prints_plain_answers_on_stdout(chat_model, tmp_path):
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [BASE, "chat", str(chat_model), "--device", "cpu", "--seed", "0", "--max-tokens", "6"],
        input='hello\n"""\ntwo\nlines\n"""\n',
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout + result.stderr  # no terminal codes when not a terminal
    assert result.stdout.count("\n") >= 2  # two answers, each ended by a newline
    assert len(re.findall(r"decode 6 tokens .* context \d+/4096", result.stderr)) == 2
    assert ">>>" not in result.stdout


def test_run_without_a_prompt_opens_the_chat(chat_model, tmp_path):
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home"), "TERM": "xterm"}
    child = pexpect.spawn(
        BASE, ["run", str(chat_model), "--device", "cpu", "-n", "5"], env=env, encoding="utf-8", timeout=TIMEOUT_S
    )
    child.expect_exact("base chat · ")
    child.expect_exact(">>> ")
    _ask(
        child,
        "/set",
        "temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0, max_tokens=5, seed=None",
    )
    _ask(child, "hello", r"decode 5 tokens")
    assert _quit(child) == 0


def test_run_without_a_prompt_refuses_a_prompts_options(chat_model):
    result = subprocess.run([BASE, "run", str(chat_model), "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --raw, --json and --logprobs need a prompt: base run MODEL PROMPT"


def test_resume_reopens_the_last_conversation_and_its_prompt_comes_from_the_cache_file(chat_model, tmp_path):
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}

    def chat(*args: str, text: str) -> str:
        result = subprocess.run(
            [BASE, "chat", str(chat_model), "--device", "cpu", "--seed", "0", "--max-tokens", "40", *args],
            input=text,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stderr

    first = chat(text="Tell me about the sea and the ships that sail on it, in many words please.\n")
    (first_prefill,) = re.findall(r"prefill (\d+) tokens \((\d+) cached\)", first)
    assert first_prefill[1] == "0"
    assert (tmp_path / "home" / "chat_last.json").exists()
    assert list((tmp_path / "home" / "prefix_cache").glob("*.kvc"))
    resumed = chat("--resume", text="And the harbours?\n")
    assert "resumed 2 messages" in resumed
    (prefill,) = re.findall(r"prefill (\d+) tokens \((\d+) cached\)", resumed)
    total, cached = map(int, prefill)
    assert total > int(first_prefill[0]) and cached >= 16 * ((int(first_prefill[0]) + 40) // 16 - 1)
    fresh = chat("--prefix-cache-file", "none", "--resume", text="And the harbours?\n")
    (prefill,) = re.findall(r"prefill (\d+) tokens \((\d+) cached\)", fresh)
    assert prefill[1] == "0"  # without the file, the same prompt starts cold


def test_a_reasoning_models_thinking_is_dimmed_apart_from_the_answer(tmp_path):
    folder = write_model_folder(tmp_path / "thinking", eos=False)
    (folder / "chat_template.jinja").write_text(thinking_template())  # the answer starts inside <think>
    child = _spawn(folder, tmp_path / "home", "--max-tokens", "8")
    try:
        child.sendline("hello")
        child.expect_exact("\x1b[2;3m")  # the thinking, dim italic, once the live view is gone
        child.expect_exact(">>> ")
        assert "<think>" not in child.before and "</think>" not in child.before
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def test_model_switches_to_another_model_and_the_conversation_goes_on(chat_model, tmp_path):
    other = write_model_folder(tmp_path / "other", eos=False, max_position_embeddings=2048)
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "8")
    try:
        _ask(child, "/system Be brief.", "system prompt set")
        _ask(child, "hello there", r"context \d+/4096")
        _ask(child, "/set temperature 0.5", "temperature=0.5")
        _ask(child, "/model", f"model: {chat_model.name} · context 4096 tokens")
        _ask(child, "/model nothing-stored", "cannot switch to nothing-stored: .*; still chatting with chat_model")
        _ask(
            child,
            f"/model {other}",
            r"now chatting with other · context 2048 tokens · 2 messages kept; temperature=0\.5",
        )
        _ask(child, "and now?", r"decode 8 tokens [\d.]+ tok/s · context \d+/2048")
        _ask(child, f"/save {tmp_path / 'after.json'}", "saved 4 messages")
        saved = json.loads((tmp_path / "after.json").read_text())
        assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert saved["model"] == "other"
        assert _quit(child) == 0
    finally:
        child.close(force=True)


def test_image_command_attaches_an_image_to_the_next_message(tmp_path):
    env = {**os.environ, "BASE_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [BASE, "chat", str(FOLDER), "--device", "cpu", "--temperature", "0", "--max-tokens", "8"],
        input=f"/image {tmp_path / 'missing.png'}\n/image {IMAGE_A}\n{PROMPT_1}\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "cannot read" in result.stderr and f"{IMAGE_A} (40x30) goes with your next message" in result.stderr
    expected = loaded_vlm().tokenizer.decode(reference()["greedy_1"].tolist(), skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == expected.rstrip("\n")
