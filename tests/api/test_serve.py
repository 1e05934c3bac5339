"""`base serve` as a process: banner, answers, and a clean exit on SIGTERM/SIGINT with streams in flight."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER as TOKENIZER
from tests.tiny_model import write_model_folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """An HF folder `load_model` reads: the widened tiny llama and the fixture BPE tokenizer."""
    return write_model_folder(tmp_path_factory.mktemp("tiny-chatml"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model: Path | str | None, *args: str, timeout: float = 120.0) -> None:
        """`base serve MODEL ARGS`; `model` None serves every model of the store (`$BASE_HOME`)."""
        self.port = _free_port()
        models = [] if model is None else [str(model)]
        command = [sys.executable, "-m", "baselm.cli", "serve", *models, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._output = threading.Condition()  # notified on each line read and at the end of the output
        self._output_ended = False
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("base serve did not start:\n" + "".join(self.lines))
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._output:
                self.lines.append(line)
                self._output.notify_all()
        with self._output:
            self._output_ended = True
            self._output.notify_all()

    def output_through(self, text: str, timeout: float = 60.0) -> str:
        """All output so far, once it holds `text`: the reader thread may lag behind what the server printed."""
        with self._output:
            self._output.wait_for(lambda: text in "".join(self.lines) or self._output_ended, timeout)
            output = "".join(self.lines)
        if text not in output:
            pytest.fail(f"base serve did not print {text!r}; it printed:\n{output}")
        return output

    def output(self, timeout: float = 60.0) -> str:
        """All the output, once the process has closed it."""
        with self._output:
            self._output.wait_for(lambda: self._output_ended, timeout)
            return "".join(self.lines)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.parametrize(("sig", "host"), [(signal.SIGTERM, "127.0.0.1"), (signal.SIGINT, "0.0.0.0")])
def test_serve_answers_then_exits_0_on_a_signal_after_finishing_streams(model_folder, sig, host):
    served = ServeProcess(
        model_folder, "--host", host, "--kv-memory", "4MiB", "--served-model-name", "tiny-chat", "--max-num-seqs", "4"
    )
    try:
        banner = served.output_through('"model": "tiny-chat"')  # the banner's last line
        assert ("without an API key" in banner) == (host == "0.0.0.0")  # a loud warning off loopback
        assert f"http://127.0.0.1:{served.port}/v1" in banner
        assert f"curl http://127.0.0.1:{served.port}/v1/chat/completions" in banner and '"model": "tiny-chat"' in banner
        client = served.openai()
        # Sampled (the default temperature), so ignore_eos: the random model may draw its end token first.
        answer = client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            seed=0,
            extra_body={"ignore_eos": True},
        )
        assert answer.usage.completion_tokens == 3
        stream = client.completions.create(
            model="tiny-chat",
            prompt="Count:",
            max_tokens=150,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        served.proc.send_signal(sig)
        for chunk in chunks:  # the stream in flight is finished, not cut
            text += "".join(c.text for c in chunk.choices)
        assert served.proc.wait(60) == 0
        whole = len(Tokenizer.from_folder(TOKENIZER).encode(text, add_special_tokens=False))
        assert whole > 100  # 150 tokens re-encode to about as many
    finally:
        served.close()


def test_serve_refuses_a_missing_model_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "baselm.cli", "serve", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and "nothing" in result.stderr and "Traceback" not in result.stderr


def test_serve_reads_the_api_key_from_a_file_kept_out_of_its_command_line(model_folder, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")  # as `echo s3cret > key` writes it: the one trailing newline is not the key's
    served = ServeProcess(model_folder, "--api-key-file", str(key_file), "--kv-memory", "4MiB")
    try:
        assert httpx.get(f"{served.url}/v1/models", timeout=30).status_code == 401
        authorized = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{served.url}/v1/models", headers=authorized, timeout=30).status_code == 200
        assert "s3cret" not in " ".join(served.proc.args)
    finally:
        served.close()


@pytest.mark.parametrize(("content", "says"), [(None, "no such file"), ("\n", "is empty"), ("a\nb\n", "one line")])
def test_serve_refuses_a_missing_or_empty_key_file_with_one_line(model_folder, tmp_path, content, says):
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    env = {k: v for k, v in os.environ.items() if k != "BASE_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "baselm.cli", "serve", str(model_folder), "--api-key-file", str(key_file)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and says in result.stderr and "Traceback" not in result.stderr
    assert str(key_file) in result.stderr


@pytest.mark.slow
def test_smollm2_served_from_its_gguf_knows_the_capital_of_france(smollm2_gguf):
    served = ServeProcess(smollm2_gguf, "--kv-memory", "64MiB", "--max-model-len", "1024", timeout=180)
    try:
        client = served.openai()
        [model] = client.models.list().data
        answer = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=model.id,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=40,
                temperature=0,
                stream=True,
            )
            if c.choices
        )
        assert streamed == answer.choices[0].message.content
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        }
        structured = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        )
        assert json.loads(structured.choices[0].message.content) == {"city": "Paris"}
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
    finally:
        served.close()


def test_serve_saves_its_prefix_cache_and_exits_0_after_a_multi_prompt_request_got_429(model_folder, tmp_path):
    cache_file = tmp_path / "prefix.kvc"
    served = ServeProcess(
        model_folder, "--kv-memory", "4MiB", "--max-num-seqs", "1", "--max-waiting", "1",
        "--prefix-cache-file", str(cache_file),
    )  # fmt: skip
    try:
        client = served.openai()
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="two " * 40, max_tokens=1).usage.prompt_tokens > 32
        # One request runs, one waits: the third prompt finds the queue full (the first two were queued, then aborted).
        response = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": model, "prompt": ["one " * 40] * 3, "max_tokens": 1000, "ignore_eos": True},
            timeout=60,
        )
        assert response.status_code == 429
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
        assert "Traceback" not in served.output()  # the engine thread stopped on its own, not with an error
        assert cache_file.stat().st_size > 0  # and saved the cached blocks of the first prompt
    finally:
        served.close()


def test_serve_answers_503_past_max_connections_open_at_once(model_folder):
    served = ServeProcess(model_folder, "--kv-memory", "4MiB", "--max-connections", "2")
    held = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(2)]
    try:
        for sock in held:  # each connection answered, then kept open (HTTP/1.1 keep-alive)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert httpx.get(f"{served.url}/health", timeout=30).status_code == 503
        held.pop().close()
        assert _eventually_healthy(served)
    finally:
        for sock in held:
            sock.close()
        served.close()


def _eventually_healthy(served: ServeProcess, timeout: float = 30.0) -> bool:
    """Whether /health answers 200 within `timeout`: a closed connection leaves the count once the server sees it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{served.url}/health", timeout=30).status_code == 200:
            return True
        time.sleep(0.05)
    return False


def test_serve_says_its_defaults_at_start_and_logs_a_json_object_per_request(model_folder):
    served = ServeProcess(
        model_folder, "--kv-memory", "4MiB", "--log-format", "json", "--temperature", "0", "--max-tokens", "5"
    )
    try:
        banner = served.output_through("Try:")
        assert (
            "Requests that leave them out get temperature 0, top_p 0.95, top_k 40, min_p 0.05, repetition_penalty 1 "
            "(from the command line, then llama.cpp) and at most 5 tokens; "
            "an answer that repeats one n-gram for 256 tokens is cut (--runaway-guard)."
        ) in banner
        done = served.openai().chat.completions.create(
            model=model_folder.name, messages=[{"role": "user", "content": "hi"}]
        )
        output = served.output_through('"route": "/v1/chat/completions"')
        [entry] = [json.loads(line) for line in output.splitlines() if '"route": "/v1/chat/completions"' in line]
        assert (entry["level"], entry["status"], entry["generated_tokens"]) == (
            "info",
            200,
            done.usage.completion_tokens,
        )
        assert entry["generated_tokens"] <= 5 and entry["finish_reason"] == done.choices[0].finish_reason
    finally:
        served.close()


def test_serve_refuses_an_unknown_log_format_with_one_line(model_folder):
    command = [sys.executable, "-m", "baselm.cli", "serve", str(model_folder), "--log-format", "yaml"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "--log-format must be one of text, json, not 'yaml'" in result.stderr and "Traceback" not in result.stderr


def test_serve_serves_lora_adapters_by_name_beside_the_model(model_folder):
    from tests.lora_files import PEFT

    served = ServeProcess(model_folder, "--kv-memory", "4MiB", "--lora", f"sql={PEFT}:0.5")
    try:
        assert f"LoRA adapters of {model_folder.name}, each a model name of its own: sql\n" in served.output_through(
            "Try:"
        )
        client = served.openai()
        cards = {card.id: card for card in client.models.list().data}
        assert (cards["sql"].parent, cards["sql"].root) == (model_folder.name, str(PEFT))
        messages = [{"role": "user", "content": "hi"}]
        answers = [
            client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=6)
            for name in ("sql", model_folder.name)
        ]
        assert answers[0].model == "sql"
        assert answers[0].choices[0].message.content != answers[1].choices[0].message.content
        scales = httpx.get(f"{served.url}/lora-adapters").json()
        assert scales == [{"id": 0, "name": "sql", "path": str(PEFT), "scale": 0.0}]
    finally:
        served.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lora", "nameless"], "--lora 'nameless': give NAME=PATH[:scale], a name without spaces"),
        (["--lora", "a=/nowhere"], "/nowhere: no adapter_config.json"),
        (["--lora", "a=ADAPTER", "--tensor-parallel", "2"], "--lora serves adapters from one process"),
        (["--lora", "MODEL=ADAPTER"], "that is the served model's name; give the adapter another"),
    ],
)
def test_serve_refuses_lora_adapters_it_cannot_serve_with_one_line(model_folder, args, says):
    from tests.lora_files import PEFT

    args = [a.replace("ADAPTER", str(PEFT)).replace("MODEL", model_folder.name) for a in args]
    command = [sys.executable, "-m", "baselm.cli", "serve", str(model_folder), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert says in result.stderr and "Traceback" not in result.stderr, result.stderr
