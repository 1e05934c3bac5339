"""`base serve` with no model as a process: every model of the store served, each loaded on its first
request; and the command line's refusals of what a pool cannot do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.api.pool_server import tiny_store
from tests.api.test_serve import ServeProcess


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    refs = tiny_store(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BASE_HOME", str(root))
        yield refs


def test_serve_with_no_model_serves_every_stored_model_on_demand(store):
    served = ServeProcess(None, "--kv-memory", "4MiB", "--max-loaded-models", "1", "--keep-alive", "10m")
    try:
        banner = served.output_through("Try:")
        assert f"Serving {len(store)} models at http://127.0.0.1:{served.port}/v1" in banner
        assert all(ref in banner for ref in store) and "10m after its last" in banner and "at most 1 loaded" in banner
        client = served.openai()
        assert sorted(m.id for m in client.models.list().data) == sorted(store)
        for ref in store[:2]:
            answer = client.chat.completions.create(
                model=ref, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
            )
            assert answer.model == ref
        status = {m.id: m.model_extra["status"]["value"] for m in client.models.list().data}
        assert status == {**dict.fromkeys(store, "unloaded"), store[1]: "loaded"}  # at most one loaded
    finally:
        served.close()


def test_serve_with_several_models_serves_those_alone(store):
    served = ServeProcess(store[0], store[2], "--kv-memory", "4MiB")
    try:
        served.output_through("Try:")
        assert sorted(m.id for m in served.openai().models.list().data) == sorted([store[0], store[2]])
    finally:
        served.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--served-model-name", "x"], "--served-model-name names one model"),
        (["--keep-alive", "soon"], "--keep-alive"),
        (["org/nothing:q4", "org/tiny:q8"], "no stored model named"),
        (["--adapter", "some/folder"], "--adapter applies to the one model served"),
        (["--lora", "a=some/folder"], "--lora serves adapters of the one model served"),
    ],
)
def test_serve_refuses_what_a_pool_cannot_do_with_one_line(store, args, says):
    result = subprocess.run(
        [sys.executable, "-m", "baselm.cli", "serve", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr


def test_serve_one_model_with_an_adapter_answers_as_the_adapted_model(store):
    from tests.paths import FIXTURES

    answers = []
    for extra in ((), ("--adapter", str(FIXTURES / "adapters" / "peft-llama"))):
        served = ServeProcess(store[0], "--kv-memory", "4MiB", *extra)
        try:
            served.output_through("Try:")
            completion = served.openai().completions.create(model=store[0], prompt="hello", max_tokens=8, temperature=0)
            answers.append(completion.choices[0].text)
        finally:
            served.close()
    assert answers[0] != answers[1]


def test_serve_one_model_serves_a_model_pulled_through_its_api_beside_it(store, tmp_path):
    import httpx

    from tests.tiny_model import write_model_folder

    folder = write_model_folder(tmp_path / "pulled-beside", max_position_embeddings=512)
    served = ServeProcess(store[0], "--kv-memory", "4MiB")
    try:
        served.output_through("Try:")
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=120) as http:
            done = json.loads(http.post("/api/pull", json={"model": str(folder)}).text.splitlines()[-1])
            assert done["status"] == "success" and done["model"] not in store
            body = {"model": done["model"], "prompt": "Hi", "stream": False, "options": {"num_predict": 3}}
            assert http.post("/api/generate", json=body).json()["done"]
            assert sorted(m["id"] for m in http.get("/v1/models").json()["data"]) == sorted([store[0], done["model"]])
            assert http.request("DELETE", "/api/delete", json={"model": done["model"]}).status_code == 200
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [store[0]]
            body["model"] = store[0]  # the model the server started with is still there, and answers
            assert http.post("/api/generate", json=body).json()["done"]
    finally:
        served.close()
