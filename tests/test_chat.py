"""`base chat`: settings, multi-line input, prompts that extend the previous turn, saved chats,
the prefix cache across turns, and the REPL itself driven through a pseudo-terminal."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pexpect
import pytest
from rich.console import Console

from baselm.backend import select_backend
from baselm.chat import (
    AnswerView,
    ChatCommandError,
    ChatSettings,
    Conversation,
    join_continued,
    load_chat,
    save_chat,
)
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling import SamplingParams
from baselm.tokenizer.tokenizer import Tokenizer
from tests.tiny_model import write_model_folder

FIXTURES = Path(__file__).parent / "fixtures"
BPE = FIXTURES / "tokenizers" / "bpe"
BASE = shutil.which("base") or str(Path(sys.executable).parent / "base")
TIMEOUT_S = 15  # for any one expected output of the REPL


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The widened tiny llama (tests/tiny_model.py) with a 4096-token context and no
    end-of-sequence token, so every answer runs to max_tokens."""
    return write_model_folder(tmp_path_factory.mktemp("chat_model"), eos=False, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(BPE)


# ---- settings and input ---------------------------------------------------------------------


def test_set_reads_each_setting():
    settings = ChatSettings()
    assert settings.with_value("temperature", "0.2").temperature == 0.2
    assert settings.with_value("top_p", "0.5").top_p == 0.5
    assert settings.with_value("max_tokens", "64").max_tokens == 64
    assert settings.with_value("max_tokens", "none").max_tokens is None
    assert settings.with_value("seed", "7").seed == 7
    assert settings.with_value("seed", "off").seed is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", "hot", "temperature takes a number, got 'hot'"),
        ("temperature", "-1", "temperature must lie in [0.0, inf), got -1.0."),
        ("top_p", "1.5", "top_p must lie in (0.0, 1.0], got 1.5."),
        ("max_tokens", "0", "max_tokens must be at least 1, got 0."),
        ("max_tokens", "2.5", "max_tokens takes a whole number (or none), got '2.5'"),
        ("colour", "red", "/set knows temperature, top_p, max_tokens, seed; got 'colour'"),
    ],
)
def test_set_rejects_a_bad_value_with_a_message(name, value, message):
    with pytest.raises(ChatCommandError) as caught:
        ChatSettings().with_value(name, value)
    assert str(caught.value) == message


def test_a_trailing_backslash_continues_the_line():
    more = iter(["second \\", "third"])
    assert join_continued("first \\", lambda: next(more)) == "first \nsecond \nthird"


def test_triple_quotes_enclose_a_block():
    more = iter(["line one", "", "line two", '"""'])
    assert join_continued('"""', lambda: next(more)) == "line one\n\nline two"
    assert join_continued('"""one line"""', lambda: "") == "one line"


def test_a_finished_answer_is_rendered_as_markdown_in_a_terminal():
    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=60, height=20)
    with AnswerView(console, rich_output=True) as view:
        view.add("Two **points**:\n\n- first", 5)
        view.add("\n- second\n", 3)
    final = file.getvalue().rsplit("\x1b[2K", 1)[-1]  # what stays after the live view is erased
    final = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", final)
    assert "• first" in final and "• second" in final
    assert "**" not in final and "tokens · Ctrl-C stops" not in final


def test_an_answer_is_plain_text_when_stdout_is_not_a_terminal(capsys):
    with AnswerView(Console(file=io.StringIO()), rich_output=False) as view:
        view.add("Two **points**:\n\n- first", 5)
    assert capsys.readouterr().out == "Two **points**:\n\n- first\n"


# ---- prompts across turns -------------------------------------------------------------------


def test_fixture_template_renders_append_only(tokenizer):
    """The rendered conversation plus the answer is a prefix of the next turn's render."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    first = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    messages += [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "More"}]
    second = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert second.startswith(first + "Hello there")
    tail = second[len(first + "Hello there") :]
    assert tail == "<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"


def test_next_prompt_starts_with_the_previous_prompt_and_the_generated_ids(tokenizer):
    conversation = Conversation(tokenizer, system="Be brief.")
    first = conversation.next_prompt("Hi")
    assert first.token_ids == tokenizer.encode_chat(conversation.messages + [{"role": "user", "content": "Hi"}])

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    answer_ids = encode("Hel") + encode("lo there")
    assert answer_ids != encode("Hello there")  # the model split the text its own way
    conversation.add_turn(first, "Hi", "Hello there", answer_ids)
    second = conversation.next_prompt("More")
    assert second.num_reused_ids == len(first.token_ids) + len(answer_ids)
    assert second.token_ids[: second.num_reused_ids] == first.token_ids + answer_ids
    assert tokenizer.decode(second.token_ids) == second.text


def test_an_answer_whose_ids_read_differently_reuses_only_the_prompt(tokenizer):
    conversation = Conversation(tokenizer)
    first = conversation.next_prompt("Hi")
    conversation.add_turn(first, "Hi", "Hello", tokenizer.encode("Goodbye", add_special_tokens=False))
    second = conversation.next_prompt("More")
    assert second.num_reused_ids == len(first.token_ids)
    assert second.token_ids[: len(first.token_ids)] == first.token_ids
    assert second.token_ids == tokenizer.encode_chat(conversation.messages + [{"role": "user", "content": "More"}])


def test_a_new_system_prompt_encodes_the_conversation_whole(tokenizer):
    conversation = Conversation(tokenizer)
    first = conversation.next_prompt("Hi")
    conversation.add_turn(first, "Hi", "Hello", tokenizer.encode("Hello", add_special_tokens=False))
    conversation.set_system("Answer in French.")
    second = conversation.next_prompt("More")
    assert second.num_reused_ids == 0
    assert conversation.messages[0] == {"role": "system", "content": "Answer in French."}
    assert second.token_ids == tokenizer.encode_chat(conversation.messages + [{"role": "user", "content": "More"}])


def test_clear_keeps_only_the_system_prompt(tokenizer):
    conversation = Conversation(tokenizer, system="Be brief.")
    prompt = conversation.next_prompt("Hi")
    conversation.add_turn(prompt, "Hi", "Hello", tokenizer.encode("Hello", add_special_tokens=False))
    conversation.clear()
    assert conversation.messages == [{"role": "system", "content": "Be brief."}]
    assert conversation.next_prompt("Hi").num_reused_ids == 0


def test_second_turn_finds_the_first_in_the_prefix_cache(chat_model):
    """Turn 2 gets every full block of turn 1's computed tokens (its prompt and all but the last
    generated id, which is never fed back) from the cache."""
    loaded = load_model(str(chat_model), select_backend("cpu"))
    engine = LLMEngine(loaded, EngineConfig(kv_memory=8 * 2**20, block_size=16))
    conversation = Conversation(loaded.tokenizer, system="Be brief.")
    params = SamplingParams(temperature=0.0, max_tokens=20)
    first = conversation.next_prompt("What is a prefix cache?")
    result = engine.generate([first.token_ids], params)[0]
    answer = result.completions[0]
    conversation.add_turn(first, "What is a prefix cache?", answer.text, answer.token_ids)
    second = conversation.next_prompt("And why does it help?")
    assert second.num_reused_ids == len(first.token_ids) + len(answer.token_ids)
    cached = engine.generate([second.token_ids], params)[0].num_cached_tokens
    computed = len(first.token_ids) + len(answer.token_ids) - 1
    assert cached == computed // 16 * 16
    assert cached > 0


# ---- saved chats ------------------------------------------------------------------------------


def test_save_then_load_gives_the_same_conversation_and_settings(tokenizer, tmp_path):
    conversation = Conversation(tokenizer, system="Be brief.")
    prompt = conversation.next_prompt("Hi")
    conversation.add_turn(prompt, "Hi", "Hello", tokenizer.encode("Hello", add_special_tokens=False))
    settings = ChatSettings(temperature=0.3, top_p=0.8, max_tokens=12, seed=5)
    save_chat(tmp_path / "chat.json", conversation, settings, "tiny")
    restored = Conversation(tokenizer)
    assert load_chat(tmp_path / "chat.json", restored) == settings
    assert restored.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ('{"messages": []}', "is not a saved chat (no format 'base-chat' with a messages list)"),
        ('{"format": "base-chat", "messages": [{"role": "tool", "content": "x"}]}', "message 0 has role 'tool'"),
        ('{"format": "base-chat", "messages": [], "settings": {"top_p": 2}}', "bad settings: top_p must lie in"),
    ],
)
def test_load_refuses_a_file_that_is_not_a_saved_chat(tokenizer, tmp_path, text, message):
    (tmp_path / "chat.json").write_text(text)
    with pytest.raises(ChatCommandError, match=re.escape(message)):
        load_chat(tmp_path / "chat.json", Conversation(tokenizer))


# ---- the REPL in a terminal -----------------------------------------------------------------


def _spawn(chat_model: Path, home: Path, *args: str) -> pexpect.spawn:
    env = {**os.environ, "BASE_HOME": str(home), "TERM": "xterm", "COLUMNS": "200", "LINES": "40"}
    child = pexpect.spawn(
        BASE,
        ["chat", str(chat_model), "--device", "cpu", "--seed", "0", *args],
        env=env,
        encoding="utf-8",
        timeout=TIMEOUT_S,
        dimensions=(40, 200),
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


def test_repl_answers_and_runs_its_commands(chat_model, tmp_path):
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "8")
    try:
        _ask(child, "/help", "Multi-line input")
        _ask(child, "/system Be brief.", "system prompt set")
        _ask(child, "hello there", r"decode 8 tokens [\d.]+ tok/s · context \d+/4096")
        _ask(child, "/set temperature hot", "error: temperature takes a number, got 'hot'")
        _ask(child, "/frobnicate", "unknown command /frobnicate; commands: /help")
        _ask(child, f"/save {tmp_path / 'one.json'}", "saved 2 messages")
        saved = json.loads((tmp_path / "one.json").read_text())
        assert saved["settings"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 8, "seed": 0}
        assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]
        assert saved["messages"][0]["content"] == "Be brief."
        assert saved["messages"][2]["content"]  # the random model's text came back
        _ask(child, "/clear", "conversation cleared")
        _ask(child, f"/save {tmp_path / 'empty.json'}", "saved 0 messages")
        _ask(child, f"/load {tmp_path / 'one.json'}", "loaded 2 messages")
        _ask(child, f"/save {tmp_path / 'two.json'}", "saved 2 messages")
        assert json.loads((tmp_path / "two.json").read_text())["messages"] == saved["messages"]
        _ask(child, "/stats", r"last turn: \d+ prompt tokens, 0 cached, 8 generated \(length\)", "session: 1 turns")
        child.sendline("/quit")
        assert _leave(child) == 0
    finally:
        child.close(force=True)


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(chat_model, tmp_path):
    child = _spawn(chat_model, tmp_path / "home", "--max-tokens", "3000")
    try:
        child.sendline("tell me a long story")
        child.expect(r"[1-9]\d* tokens · Ctrl-C stops")  # the answer is streaming
        child.sendintr()
        child.expect("stopped")
        child.expect_exact(">>> ")
        _ask(child, "/stats", r"generated \(abort\)")
        _ask(child, "/set max_tokens 4", "max_tokens=4")
        child.sendline("and now briefly")
        child.expect(r"\((\d+) cached\)")
        assert int(child.match.group(1)) > 0  # the stopped answer's blocks serve the next turn
        child.expect("decode 4 tokens")
        child.expect_exact(">>> ")
        child.sendline("/quit")
        assert _leave(child) == 0
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
        child.sendline("/quit")
        assert _leave(child) == 0
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
        child.sendintr()  # the REPL's answer was still running alongside
        child.expect("stopped")
        child.expect_exact(">>> ")
        child.sendline("/quit")
        assert _leave(child) == 0
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


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_turns_extend_each_other_and_hit_the_cache(smollm2_gguf):
    loaded = load_model(str(smollm2_gguf), select_backend("cpu"))
    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}]
    first_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    messages += [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True).startswith(first_text + "Blue.")

    engine = LLMEngine(loaded, EngineConfig(kv_memory=64 * 2**20))
    conversation = Conversation(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    first = conversation.next_prompt("Name a colour.")
    answer = engine.generate([first.token_ids], params)[0].completions[0]
    answer_ids = answer.token_ids[:-1] if answer.finish_reason == "stop" else answer.token_ids
    conversation.add_turn(first, "Name a colour.", answer.text, answer_ids)
    second = conversation.next_prompt("Another?")
    assert second.num_reused_ids == len(first.token_ids) + len(answer_ids)
    cached = engine.generate([second.token_ids], params)[0].num_cached_tokens
    computed = len(first.token_ids) + len(answer.token_ids) - 1
    assert cached == min(computed, len(second.token_ids) - 1) // 16 * 16
    assert cached > 0
