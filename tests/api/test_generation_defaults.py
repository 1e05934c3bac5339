"""What a request that leaves sampling or its length out gets from a real server, and the runaway guard
ending an answer that loops (baselm/sampling/defaults.py, baselm/outputs.py)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest

from baselm.sampling.defaults import SamplingDefaults, default_max_tokens
from tests.api.conftest import MODEL, RunningServer
from tests.tiny_model import loaded_widened_llama

ASK = [{"role": "user", "content": "hello"}]
LOOP = {"150": 100}  # a logit bias that makes token 150 win every step: an answer that repeats one token


@pytest.fixture(scope="module")
def greedy_server():
    """A server whose command line sets temperature 0 and a 5-token cap."""
    running = RunningServer(sampling=SamplingDefaults(temperature=0.0, max_tokens=5))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def greedy_model_server():
    """A server of a model whose generation_config says temperature 0."""
    loaded = loaded_widened_llama(MODEL)
    loaded = dataclasses.replace(loaded, config={**loaded.config, "generation_config": {"temperature": 0.0}})
    running = RunningServer(loaded=loaded)
    yield running
    running.stop()


def ollama_answers(server: RunningServer, seeds: tuple[int, ...] = (1, 2, 3)) -> set[str]:
    """/api/generate's answers to one prompt, without sampling options, under each seed."""
    answers = set()
    with server.http() as http:
        for seed in seeds:
            body = {"model": MODEL, "prompt": "hello", "stream": False, "options": {"seed": seed, "num_predict": 12}}
            answers.add(http.post("/api/generate", json=body).json()["response"])
    return answers


def test_the_model_card_says_the_cap_and_the_sampling_defaults(server):
    with server.http() as http:
        card = http.get(f"/v1/models/{MODEL}").json()
    assert card["max_tokens"] == default_max_tokens(card["max_model_len"])
    assert card["sampling_defaults"] == {
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.0,
    }


def test_a_response_left_without_sampling_gets_llama_cpps_and_the_cap(server):
    client = server.openai()
    response = client.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.8, 0.95, 4)
    card = client.models.retrieve(MODEL)
    response = client.responses.create(model=MODEL, input="hello", temperature=0.3)
    assert (response.temperature, response.max_output_tokens) == (0.3, card.max_tokens)


def test_the_command_lines_defaults_apply_to_what_a_request_leaves_out(greedy_server):
    client = greedy_server.openai()
    answers = set()
    for seed in (1, 2, 3):
        done = client.chat.completions.create(model=MODEL, messages=ASK, seed=seed, extra_body={"ignore_eos": True})
        assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 5)
        answers.add(done.choices[0].message.content)
    assert len(answers) == 1  # greedy, whatever the seed
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=7, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 7  # the request's own limit wins


def test_ollamas_own_defaults_give_way_to_the_command_line_and_the_model(server, greedy_server, greedy_model_server):
    assert len(ollama_answers(server)) > 1  # Ollama's temperature 0.8: each seed its own answer
    assert len(ollama_answers(greedy_server)) == 1
    assert len(ollama_answers(greedy_model_server)) == 1


def test_an_answer_that_repeats_itself_is_cut_with_length_after_256_tokens(server, caplog):
    client = server.openai()
    with caplog.at_level(logging.WARNING, logger="baselm.engine"):
        done = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=400, logit_bias=LOOP)
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 257)
    [record] = [r for r in caplog.records if r.name == "baselm.engine"]
    assert "cut after 257 tokens: the last 256 repeat a 1-token sequence" in record.getMessage()


def test_a_streamed_runaway_ends_with_length(server):
    chunks = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=400, logit_bias=LOOP, stream=True
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]


def test_with_the_guard_off_the_same_loop_runs_to_max_tokens():
    running = RunningServer(runaway_guard=0)
    try:
        done = running.openai().chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=300, logit_bias=LOOP
        )
        assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 300)
    finally:
        running.stop()


def test_a_bad_command_line_default_is_one_clear_line_before_any_model_loads(tmp_path):
    command = [sys.executable, "-m", "baselm.cli", "serve", str(tmp_path / "none.gguf"), "--top-p", "1.5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "top_p must lie in (0.0, 1.0], got 1.5." in result.stderr and "Traceback" not in result.stderr
