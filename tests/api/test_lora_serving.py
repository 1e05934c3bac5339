"""LoRA adapters served by name over HTTP (`base serve MODEL --lora NAME=PATH`), on a real server on
loopback with the real `openai` client: the model name picks the adapter on every protocol, llama-server's
`lora` field and /lora-adapters pick and set scales, listings name each adapter's parent, and unknown
names and ids are refused by name.

The model: the widened tiny llama with no end-of-sequence token (every answer runs to max_tokens), serving
"a" (the PEFT fixture) and "b" (a seeded adapter on other projections). An answer's reference is the same
request on an engine whose model has that adapter merged at load.
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import openai
import pytest

from baselm.adapters import read_adapter
from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from baselm.sampling.params import SamplingParams
from baselm.served_adapters import AdapterSpec
from tests.api.conftest import RunningServer
from tests.lora_files import PEFT, peft_adapter
from tests.tiny_model import write_model_folder

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora-serving")
    folder = write_model_folder(tmp / "model", eos=False)
    return {"model": folder, "a": PEFT, "b": peft_adapter(tmp / "b", ("k_proj", "o_proj", "gate_proj", "up_proj"), 1)}


@pytest.fixture(scope="module")
def server(files):
    specs = [AdapterSpec.read(f"a={files['a']}"), AdapterSpec.read(f"b={files['b']}")]
    loaded = load_model(str(files["model"]), select_backend("cpu"), served_adapters=specs)
    running = RunningServer(loaded=loaded, model_name=MODEL)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected(files) -> dict:
    """The greedy answer to MESSAGES of the plain model and of each adapter merged at load."""
    answers = {}
    for name in (None, "a", "b"):
        adapters = [read_adapter(str(files[name]))] if name else []
        loaded = load_model(str(files["model"]), select_backend("cpu"), adapters=adapters)
        engine = LLMEngine(loaded, EngineConfig(kv_memory=2**22))
        prompt = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
        result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        answers[name] = result.completions[0].text
    assert len(set(answers.values())) == 3  # each adapter changes the answer
    return answers


def chat(client: openai.OpenAI, model: str, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, extra_body=extra or None
    )


def test_the_model_name_picks_the_adapter_and_the_answer_says_it(server, expected):
    client = server.openai()
    for name in ("a", "b"):
        answer = chat(client, name)
        assert (answer.model, answer.choices[0].message.content) == (name, expected[name])
    plain = chat(client, MODEL)
    assert (plain.model, plain.choices[0].message.content) == (MODEL, expected[None])
    stream = client.chat.completions.create(
        model="b", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"b"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["b"]


def test_every_protocol_takes_an_adapters_name(server, expected):
    with server.http() as http:
        body = {"model": "a", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        anthropic = http.post("/v1/messages", json=body).json()
        assert (anthropic["model"], anthropic["content"][0]["text"]) == ("a", expected["a"])
        ollama_body = {"model": "b:latest", "messages": MESSAGES, "stream": False}  # Ollama's clients add the tag
        ollama = http.post(
            "/api/chat",
            json={**ollama_body, "options": {"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0}},
        )
        assert (ollama.json()["model"], ollama.json()["message"]["content"]) == ("b", expected["b"])
        responses = http.post(
            "/v1/responses",
            json={"model": "a", "input": MESSAGES, "max_output_tokens": MAX_TOKENS, "temperature": 0},
        ).json()
        assert (responses["model"], responses["output"][0]["content"][0]["text"]) == ("a", expected["a"])


def test_the_adapters_are_listed_as_models_with_their_parent(server, files):
    cards = {card.id: card for card in server.openai().models.list().data}
    assert sorted(cards) == ["a", "b", MODEL]
    assert (cards["a"].root, cards["a"].parent) == (str(files["a"]), MODEL)
    assert (cards["b"].root, cards["b"].parent) == (str(files["b"]), MODEL)
    assert cards[MODEL].parent is None
    with server.http() as http:
        assert http.get("/v1/models/b").json()["parent"] == MODEL
        tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
        ps = {m["name"]: m for m in http.get("/api/ps").json()["models"]}
    for listing in (tags, ps):
        assert listing["a"]["details"]["parent_model"] == listing["b"]["details"]["parent_model"] == MODEL
        assert listing[MODEL]["details"]["parent_model"] == ""
    assert tags["a"]["size"] == sum(f.stat().st_size for f in files["a"].iterdir())  # its files
    factors = mx.load(str(files["a"] / "adapter_model.safetensors")).values()
    assert ps["a"]["size"] == sum(f.nbytes for f in factors)  # its float32 factors in memory


def test_llama_servers_lora_field_and_default_scales(server, files, expected):
    client = server.openai()
    assert chat(client, MODEL, lora=[{"id": 1, "scale": 1.0}]).choices[0].message.content == expected["b"]
    assert chat(client, MODEL, lora=[]).choices[0].message.content == expected[None]
    completion = client.completions.create(
        model=MODEL, prompt="Hello", temperature=0, max_tokens=4, extra_body={"lora": [{"id": 0, "scale": 1.0}]}
    )
    named = client.completions.create(model="a", prompt="Hello", temperature=0, max_tokens=4)
    assert completion.choices[0].text == named.choices[0].text
    with server.http() as http:
        listed = [{"id": 0, "name": "a", "path": str(files["a"]), "scale": 0.0}]
        listed.append({"id": 1, "name": "b", "path": str(files["b"]), "scale": 0.0})
        assert http.get("/lora-adapters").json() == listed
        try:
            assert http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).json() == {"success": True}
            assert http.get("/lora-adapters").json()[0]["scale"] == 1.0
            assert chat(client, MODEL).choices[0].message.content == expected["a"]  # the default now
            assert chat(client, MODEL, lora=[]).choices[0].message.content == expected[None]  # a request's own
            assert chat(client, "b").choices[0].message.content == expected["b"]  # a name's own
        finally:
            assert http.post("/lora-adapters", json=[]).json() == {"success": True}
        assert chat(client, MODEL).choices[0].message.content == expected[None]


def test_unknown_adapters_are_refused_by_name(server):
    client = server.openai()
    with pytest.raises(openai.NotFoundError, match=r"model 'c' not found; this server serves 'tiny', 'a', 'b'"):
        chat(client, "c")
    with pytest.raises(openai.BadRequestError, match=r"adapter id 5 is not one of this model's; it serves adapters"):
        chat(client, MODEL, lora=[{"id": 5, "scale": 1.0}])
    with pytest.raises(openai.BadRequestError, match="'a' is an adapter already"):
        chat(client, "a", lora=[{"id": 1, "scale": 1.0}])
    with pytest.raises(openai.BadRequestError, match=r"lora\[0\] needs an id and a scale"):
        chat(client, MODEL, lora=[{"id": 1}])
    with server.http() as http:
        refused = http.post("/lora-adapters", json=[{"id": 2, "scale": 1.0}])
        assert refused.status_code == 400 and "adapter id 2 is not one of this model's" in refused.text
        embedding = http.post("/v1/embeddings", json={"model": "a", "input": "hello"})
        assert embedding.status_code == 400 and "'a' is a LoRA adapter" in embedding.text


def test_a_server_without_adapters_lists_none_and_refuses_a_lora_field():
    running = RunningServer()
    try:
        with running.http() as http:
            assert http.get("/lora-adapters").json() == []
            refused = http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])
            assert refused.status_code == 400 and "serves no LoRA adapters" in refused.text
        with pytest.raises(openai.BadRequestError, match="serves no LoRA adapters"):
            chat(running.openai(), running.model_name, lora=[{"id": 0, "scale": 1.0}])
        assert httpx.get(f"{running.url}/v1/models").json()["data"][0]["parent"] is None
    finally:
        running.stop()
