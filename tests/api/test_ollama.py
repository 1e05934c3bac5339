"""Ollama's API through the real `ollama` client against a live server over the tiny model."""

from __future__ import annotations

import json

import numpy as np
import ollama
import pytest

from tests.api.conftest import MODEL

GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def test_chat_answers_what_chat_completions_answers(server, client) -> None:
    answer = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    expected = server.openai().chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected.choices[0].message.content
    assert answer.done and answer.done_reason == expected.choices[0].finish_reason
    assert answer.prompt_eval_count == expected.usage.prompt_tokens
    assert answer.eval_count == expected.usage.completion_tokens
    assert answer.total_duration >= answer.eval_duration >= 0


def test_a_streamed_chat_is_ndjson_that_adds_up_to_the_whole_answer(server, client) -> None:
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    with server.http() as http, http.stream("POST", "/api/chat", json={"model": MODEL, "messages": HELLO}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and "message" in lines[-1]


def test_generate_uses_the_template_raw_skips_it_and_context_continues(server, client) -> None:
    templated = client.generate(model=MODEL, prompt="Hello there", options=GREEDY)
    chat = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
    assert templated.response == chat.message.content
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY)
    completion = server.openai().completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert raw.response == completion.choices[0].text
    assert len(raw.context) == completion.usage.prompt_tokens + completion.usage.completion_tokens
    more = client.generate(model=MODEL, prompt=" and then", raw=True, context=raw.context, options=GREEDY)
    assert more.prompt_eval_count == len(raw.context) + len(server.engine.tokenizer.encode(" and then", False))


def test_an_empty_generate_loads_the_model_and_says_so(client) -> None:
    answer = client.generate(model=MODEL)
    assert answer.done and answer.done_reason == "load" and answer.response == ""


def test_format_json_schema_constrains_the_answer(client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = client.chat(model=MODEL, messages=HELLO, format=schema, options={**GREEDY, "num_predict": 30})
    assert isinstance(json.loads(answer.message.content)["ok"], bool)


def test_tools_and_an_earlier_call_are_rendered(client) -> None:
    tool = {
        "type": "function",
        "function": {"name": "weather", "description": "Weather", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
    ]
    answer = client.chat(model=MODEL, messages=messages, tools=[tool], options=GREEDY)
    assert answer.done


def test_the_model_listings_describe_the_served_model(server, client, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BASE_HOME", str(tmp_path))  # an empty store: only the served model
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 0 and listed.details.family == "llama"
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == server.engine.max_model_len
    assert "completion" in shown.capabilities
    (running,) = client.ps().models
    assert running.model == MODEL and running.size_vram == 0
    assert server.http().get("/api/version").json()["version"]
    assert server.http().get("/").status_code == 200
    assert client.chat(model=f"{MODEL}:latest", messages=HELLO, options=GREEDY).done


def test_embed_gives_unit_vectors_and_the_older_route_the_same_direction(server, client) -> None:
    result = client.embed(model=MODEL, input=["first text", "second"])
    vectors = np.array(result.embeddings)
    hidden = server.engine.loaded.config["hidden_size"]
    assert vectors.shape == (2, hidden)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    alone = np.array(client.embed(model=MODEL, input="second").embeddings[0])
    np.testing.assert_allclose(alone, vectors[1], rtol=1e-4, atol=1e-5)
    older = np.array(client.embeddings(model=MODEL, prompt="second").embedding)
    np.testing.assert_allclose(older / np.linalg.norm(older), vectors[1], rtol=1e-4, atol=1e-5)
    assert result.prompt_eval_count == sum(len(server.engine.tokenizer.encode(t)) for t in ["first text", "second"])


def test_openai_embeddings_in_float_and_base64_agree(server) -> None:
    client = server.openai()
    floats = client.embeddings.create(model=MODEL, input=["first text", "second"], encoding_format="float")
    packed = server.http().post(
        "/v1/embeddings", json={"model": MODEL, "input": ["first text", "second"], "encoding_format": "base64"}
    )
    assert packed.status_code == 200
    import base64

    for item, raw in zip(floats.data, packed.json()["data"]):
        decoded = np.frombuffer(base64.b64decode(raw["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, item.embedding, rtol=1e-6)
    ollama_vectors = ollama.Client(host=server.url).embed(model=MODEL, input=["first text", "second"]).embeddings
    np.testing.assert_allclose(np.array(ollama_vectors), [d.embedding for d in floats.data], rtol=1e-4, atol=1e-5)
    assert floats.usage.prompt_tokens > 0


def test_errors_have_ollamas_shape(server, client) -> None:
    http = server.http()
    missing = http.post("/api/chat", json={"model": "other", "messages": HELLO})
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=MODEL, messages=HELLO, options={"temperature": "hot"})
    assert caught.value.status_code == 400 and "temperature" in caught.value.error
    unknown = http.post("/api/nothing", json={})
    assert unknown.status_code == 404 and isinstance(unknown.json()["error"], str)
    server.wait_idle()


def test_pull_streams_progress_into_the_store_and_tags_then_list_it(server, client, tmp_path, monkeypatch) -> None:
    from tests.paths import LLAMA_FIXTURE
    from tests.store.hub_server import HubServer, tiny_llama_files

    monkeypatch.setenv("BASE_HOME", str(tmp_path))
    with HubServer() as hub:
        hub.add_repo("org/Tiny-Llama", tiny_llama_files(LLAMA_FIXTURE))
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_none")
        statuses = [p.status for p in client.pull("org/Tiny-Llama:q8", stream=True)]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
        assert any(s.startswith("pulling model") for s in statuses)
        names = [m.model for m in client.list().models]
        assert names == [MODEL, "org/Tiny-Llama:q8"]
        with pytest.raises(ollama.ResponseError) as caught:
            client.pull("org/Missing", stream=False)
        assert caught.value.status_code == 400
    refused = server.http().post("/api/pull", json={"model": "/etc/passwd"})
    assert refused.status_code == 400 and "org/name" in refused.json()["error"]


def test_a_failed_pull_says_why_without_the_path_of_the_store(server, client, tmp_path, monkeypatch) -> None:
    from tests.paths import LLAMA_FIXTURE
    from tests.store.hub_server import HubServer, tiny_llama_files

    home = tmp_path / "home"
    home.write_text("a file where the store's folder should be")
    monkeypatch.setenv("BASE_HOME", str(home))
    with HubServer() as hub:
        hub.add_repo("org/Tiny-Llama", tiny_llama_files(LLAMA_FIXTURE))
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_none")
        with pytest.raises(ollama.ResponseError) as caught:
            client.pull("org/Tiny-Llama:q8", stream=False)
    assert caught.value.status_code == 400
    assert str(tmp_path) not in caught.value.error and "$BASE_HOME" in caught.value.error


def test_a_quantized_models_parameters_are_counted_as_values_not_packed_words() -> None:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from baselm.api.ollama.models import num_params
    from tests.tiny_model import loaded_fixture

    model = loaded_fixture("llama").model
    floats = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert num_params(model) == floats
    quantized = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 8))
    nn.quantize(quantized, group_size=32, bits=4)
    assert num_params(quantized) == 64 * 32 + 32 * 8 + 8
