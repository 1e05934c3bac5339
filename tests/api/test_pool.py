"""`base serve` of several models (api/pool.py): a real server on loopback over a temporary store of
three tiny models, each loaded on its first request, unloaded by keep-alive, the model limit or the
memory budget, never under a running request."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from baselm.api.pool import PoolLimits
from baselm.backend import select_backend
from baselm.loader import load_model
from tests.api.conftest import RunningServer
from tests.api.pool_server import PoolServer, mapped_bytes, tiny_store

PROMPTS = ["Hello there", "Tell me a story", "What is two plus two?", "Name a colour"]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[str]:
    """The store's models; BASE_HOME points at the store for the module's tests."""
    root = tmp_path_factory.mktemp("store")
    refs = tiny_store(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BASE_HOME", str(root))
        yield refs


@pytest.fixture
def pool_server(models):
    """A fresh server of the store's models, none loaded; stopped after the test."""
    servers: list[PoolServer] = []

    def start(limits: PoolLimits | None = None, refs: list[str] | None = None, **config) -> PoolServer:
        servers.append(PoolServer(limits, refs, **config))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _ask(client, model: str, prompt: str) -> str:
    """The streamed greedy answer of `model` to `prompt`."""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True, **GREEDY
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _one_model_answers(ref: str) -> list[str]:
    """What a server of `ref` alone answers to each prompt."""
    alone = RunningServer(loaded=load_model(ref, select_backend("cpu")), model_name=ref)
    try:
        return [_ask(alone.openai(), ref, prompt) for prompt in PROMPTS]
    finally:
        alone.stop()


def test_every_model_answers_as_its_own_server_does_at_eight_streams(models, pool_server):
    expected = {ref: _one_model_answers(ref) for ref in models[:2]}
    assert expected[models[0]] != expected[models[1]]  # two different models, or the test shows nothing
    server = pool_server()
    client = server.openai()
    asks = [(models[i % 2], i % len(PROMPTS)) for i in range(16)]  # alternating models
    with ThreadPoolExecutor(8) as streams:
        answers = list(streams.map(lambda ask: _ask(client, ask[0], PROMPTS[ask[1]]), asks))
    assert answers == [expected[ref][p] for ref, p in asks]
    assert [server.pool.entries[ref].num_loads for ref in models] == [1, 1, 0]


def test_a_burst_of_first_requests_loads_the_model_once(models, pool_server):
    server = pool_server()
    client = server.openai()
    with ThreadPoolExecutor(8) as streams:
        answers = list(streams.map(lambda _: _ask(client, models[2], PROMPTS[0]), range(8)))
    assert len(set(answers)) == 1
    assert server.pool.entries[models[2]].num_loads == 1
    assert server.loaded() == [models[2]]


def test_keep_alive_zero_unloads_the_model_once_its_answer_is_done(models, pool_server):
    import ollama

    server = pool_server()
    client = ollama.Client(host=server.url)
    answer = client.chat(model=models[0], messages=[{"role": "user", "content": "Hi"}], keep_alive=0)
    assert answer.done
    server.wait_for(lambda: server.loaded() == [], "unloaded")
    kept = client.chat(model=models[1], messages=[{"role": "user", "content": "Hi"}], keep_alive="1h")
    assert kept.done and server.loaded() == [models[1]]
    (running,) = client.ps().models
    assert running.size > 0 and running.size_vram == 0 and running.expires_at is not None


def test_keep_alive_ends_with_the_duration_the_request_gave(models, pool_server):
    server = pool_server()
    with server.http() as http:
        body = {"model": models[0], "prompt": "Hi", "stream": False, "keep_alive": "0.3s"}
        assert http.post("/api/generate", json=body).json()["done"]
    server.wait_for(lambda: server.loaded() == [], "unloaded at its keep-alive's end")


@pytest.mark.parametrize("limit", ["max_loaded", "memory_budget"])
def test_the_least_recently_used_idle_model_is_unloaded_to_make_room(models, pool_server, limit):
    first, second, third = models
    if limit == "max_loaded":
        limits = PoolLimits(keep_alive=None, max_loaded=2)
    else:
        limits = PoolLimits(keep_alive=None, memory_budget=_loaded_bytes(pool_server(), models) - 1)
    server = pool_server(limits)
    client = server.openai()
    for ref in (first, second, first):  # the second model is now the least recently used
        _ask(client, ref, PROMPTS[0])
    assert server.loaded() == sorted([first, second])
    _ask(client, third, PROMPTS[0])
    assert server.loaded() == sorted([first, third])


def _loaded_bytes(server: PoolServer, models: list[str]) -> int:
    """The bytes all `models` hold once loaded, as /api/ps reports them."""
    client = server.openai()
    for ref in models:
        _ask(client, ref, PROMPTS[0])
    with server.http() as http:
        sizes = [m["size"] for m in http.get("/api/ps").json()["models"]]
    assert len(sizes) == len(models)
    return sum(sizes)


def test_a_model_under_a_lease_is_unloaded_only_once_the_lease_ends(models, pool_server):
    server = pool_server(PoolLimits(keep_alive=None, max_loaded=1))
    release = server.hold(models[0])  # as a request being answered holds it
    with server.http() as http:
        assert http.post("/models/unload", json={"model": models[0]}).json() == {"success": True}
        assert server.loaded() == [models[0]]
    release()
    server.wait_for(lambda: server.loaded() == [], "unloaded once its lease ended")


def test_a_load_waits_while_only_models_in_use_stand_in_its_way(models, pool_server):
    server = pool_server(PoolLimits(keep_alive=None, max_loaded=1))
    release = server.hold(models[0])
    with ThreadPoolExecutor(1) as background:
        answer = background.submit(_ask, server.openai(), models[1], PROMPTS[0])
        server.wait_for(lambda: server.pool.entries[models[1]].status == "loading", "loading the second model")
        assert server.loaded() == [models[0]] and not answer.done()
        release()
        assert answer.result(120)
    assert server.loaded() == [models[1]]


def test_the_router_endpoints_load_unload_and_list_every_model_with_its_state(models, pool_server):
    server = pool_server()
    with server.http() as http:

        def statuses(path: str) -> dict[str, str]:
            return {m["id"]: m["status"]["value"] for m in http.get(path).json()["data"]}

        assert statuses("/models") == dict.fromkeys(models, "unloaded")
        assert http.post("/models/load", json={"model": models[1]}).json() == {"success": True}
        assert statuses("/v1/models") == {**dict.fromkeys(models, "unloaded"), models[1]: "loaded"}
        card = http.get(f"/v1/models/{models[1]}").json()
        assert card["max_model_len"] > 0 and "sampling_defaults" in card
        assert http.post("/models/unload", json={"model": models[1]}).json() == {"success": True}
        assert statuses("/models") == dict.fromkeys(models, "unloaded")
        assert http.post("/models/load", json={"model": models[1]}).json() == {"success": True}  # once more
        assert statuses("/models")[models[1]] == "loaded" and server.pool.entries[models[1]].num_loads == 2


def test_an_empty_ollama_request_loads_and_with_keep_alive_zero_unloads(models, pool_server):
    server = pool_server()
    with server.http() as http:
        loaded = http.post("/api/generate", json={"model": models[0]}).json()
        assert loaded["done_reason"] == "load" and loaded["done"] and server.loaded() == [models[0]]
        unloaded = http.post("/api/chat", json={"model": models[0], "messages": [], "keep_alive": 0}).json()
        assert unloaded["done_reason"] == "unload" and unloaded["message"] == {"role": "assistant", "content": ""}
    assert server.loaded() == []


def test_an_unknown_model_is_a_404_in_each_apis_shape_naming_the_served_ones(models, pool_server):
    server = pool_server()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    openai_bodies = {
        "/v1/chat/completions": chat,
        "/v1/completions": {"prompt": "Hi"},
        "/v1/responses": {"input": "Hi"},
        "/v1/embeddings": {"input": "Hi"},
    }
    with server.http() as http:
        for path, body in openai_bodies.items():
            answer = http.post(path, json={"model": "nope", **body})
            error = answer.json()["error"]
            assert answer.status_code == 404 and error["code"] == "model_not_found", path
            assert all(ref in error["message"] for ref in models), path
        anthropic = http.post("/v1/messages", json={"model": "nope", **chat})
        assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
        ollama_bodies = {"/api/chat": {"messages": []}, "/api/generate": {"prompt": "Hi"}, "/api/show": {}}
        for path, body in {**ollama_bodies, "/api/embed": {"input": "Hi"}}.items():
            answer = http.post(path, json={"model": "nope", **body})
            assert answer.status_code == 404 and models[0] in answer.json()["error"], path
    assert server.loaded() == []


def test_metrics_label_every_series_by_model(models, pool_server):
    server = pool_server()
    client = server.openai()
    for ref in models[:2]:
        _ask(client, ref, PROMPTS[0])
    with server.http() as http:
        text = http.get("/metrics").text
    for ref in models[:2]:
        assert f'base_generation_tokens_total{{model="{ref}"}} 12' in text
        assert f'base_kv_blocks_total{{model="{ref}"}}' in text
        assert f'base_requests_total{{endpoint="/v1/chat/completions",status="200",model="{ref}"}} 1' in text
    assert f'model="{models[2]}"' not in text


def test_a_local_folder_pulled_through_the_api_is_served_at_once(models, pool_server, tmp_path):
    from tests.tiny_model import write_model_folder

    folder = write_model_folder(tmp_path / "pulled-tiny", max_position_embeddings=1024)  # a fourth model
    server = pool_server()
    with server.http() as http:
        lines = http.post("/api/pull", json={"model": str(folder)}).text.splitlines()
        done = json.loads(lines[-1])
        assert done["status"] == "success" and done["model"] not in models
        answer = http.post("/api/generate", json={"model": done["model"], "prompt": "Hi", "stream": False})
        assert answer.status_code == 200 and answer.json()["done"]
        assert done["model"] in [m["name"] for m in http.get("/api/tags").json()["models"]]
        assert http.request("DELETE", "/api/delete", json={"model": done["model"]}).status_code == 200
        assert done["model"] not in [m["name"] for m in http.get("/api/tags").json()["models"]]


def test_the_ollama_client_lists_shows_chats_pulls_copies_and_deletes(models, pool_server, tmp_path):
    import ollama

    from tests.tiny_model import write_model_folder

    server = pool_server()
    client = ollama.Client(host=server.url)
    assert [m.model for m in client.list().models] == sorted(models)
    folder = write_model_folder(tmp_path / "client-pulled", max_position_embeddings=512)
    assert client.pull(str(folder)).status == "success"
    (pulled,) = {m.model for m in client.list().models} - set(models)
    assert client.generate(model=pulled, prompt="Hi").done
    assert client.delete(pulled).status == "success"
    assert [m.model for m in client.list().models] == sorted(models)
    shown = client.show(models[0])  # read from the file's header: not loaded
    assert shown.modelinfo["general.architecture"] == "llama" and server.loaded() == []
    assert client.chat(model=models[0], messages=[{"role": "user", "content": "Hi"}]).done
    assert client.copy(models[0], "org/tiny-copy").status == "success"
    copy_answer = client.chat(model="org/tiny-copy", messages=[{"role": "user", "content": "Hi"}])
    assert copy_answer.done and copy_answer.model == "org/tiny-copy:q8"
    assert client.delete("org/tiny-copy").status == "success"
    assert [m.model for m in client.list().models] == sorted(models)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="org/tiny-copy", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.status_code == 404


def test_keep_alive_zero_gives_the_models_memory_back(models, pool_server):
    # A KV pool far larger than the tiny weights and than what else the process maps and unmaps
    # meanwhile (a thread's stack or malloc arena, 8-64 MiB: 128 MiB once came back 10% short), so
    # that the process's memory shows it; on the CPU its pages stay unwritten (no memory used).
    kv_pool = 1024 * 2**20
    server = pool_server(kv_memory=kv_pool)
    before = mapped_bytes()
    with server.http() as http:
        assert http.post("/api/generate", json={"model": models[0]}).json()["done_reason"] == "load"
        loaded = mapped_bytes()
        body = {"model": models[0], "prompt": "Hi", "stream": False, "keep_alive": 0}
        assert http.post("/api/generate", json=body).json()["done"]
    server.wait_for(lambda: server.loaded() == [], "unloaded")
    after = mapped_bytes()
    assert loaded - before > 0.9 * kv_pool
    assert loaded - after > 0.9 * kv_pool


@pytest.mark.slow
def test_smollm2_beside_a_tiny_model_answers_as_it_does_alone(models, pool_server, smollm2_gguf):
    """The real model and a tiny one answering at once, each engine on its own thread: each
    stream of SmolLM2 (one request at a time, so its batches are as alone) is its own server's."""
    kv_pool = 256 * 2**20
    alone = RunningServer(
        loaded=load_model(str(smollm2_gguf), select_backend("cpu")), model_name="s", kv_memory=kv_pool
    )
    try:
        expected = [_ask(alone.openai(), "s", prompt) for prompt in PROMPTS]
    finally:
        alone.stop()
    tiny_expected = _one_model_answers(models[0])
    server = pool_server(refs=[str(smollm2_gguf), models[0]], kv_memory=kv_pool)
    client, name = server.openai(), smollm2_gguf.stem
    with ThreadPoolExecutor(2) as both:
        tiny = both.submit(lambda: [_ask(client, models[0], p) for p in PROMPTS * 3])
        real = [_ask(client, name, prompt) for prompt in PROMPTS]
    assert real == expected and tiny.result() == tiny_expected * 3


def test_an_unloaded_model_saves_its_prefix_cache_to_a_file_of_its_own(models, pool_server, tmp_path):
    cache_file = tmp_path / "prefix-cache"
    server = pool_server(prefix_cache_file=str(cache_file))
    client = server.openai()
    for ref in models[:2]:
        _ask(client, ref, PROMPTS[1])
    with server.http() as http:
        assert http.post("/models/unload", json={"model": models[0]}).json() == {"success": True}
    assert [p.name for p in tmp_path.iterdir()] == ["prefix-cache.org-tiny-q8"]  # the loaded one saves at exit


def test_every_api_answers_with_the_model_its_request_names(models, pool_server):
    server = pool_server()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bodies = {
        "/v1/chat/completions": chat,
        "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
        "/v1/messages": chat,
        "/v1/embeddings": {"input": "Hi"},
        "/api/chat": {"messages": chat["messages"], "options": {"num_predict": 4}, "stream": False},
        "/api/generate": {"prompt": "Hi", "options": {"num_predict": 4}, "stream": False},
        "/api/embed": {"input": "Hi"},
    }
    with server.http() as http:
        for ref in models:
            for path, body in bodies.items():
                answer = http.post(path, json={"model": ref, **body})
                assert answer.status_code == 200 and answer.json()["model"] == ref, path
            tokens = http.post("/tokenize", json={"model": ref, "prompt": "Hi"})
            assert tokens.status_code == 200 and tokens.json()["count"] > 0
    assert server.loaded() == sorted(models)


def test_a_server_of_a_chosen_set_serves_what_is_pulled_or_copied_into_it_and_drops_what_is_deleted(
    models, pool_server, tmp_path
):
    from tests.tiny_model import write_model_folder

    folder = write_model_folder(tmp_path / "set-pulled", max_position_embeddings=512)
    server = pool_server(refs=[models[0]])
    with server.http() as http:
        done = json.loads(http.post("/api/pull", json={"model": str(folder)}).text.splitlines()[-1])
        assert http.post("/api/generate", json={"model": done["model"], "prompt": "Hi", "stream": False}).json()["done"]
        assert http.post("/api/copy", json={"source": models[0], "destination": "org/set-copy"}).status_code == 200
        names = [m["id"] for m in http.get("/v1/models").json()["data"]]  # the served set
        assert done["model"] in names and "org/set-copy:q8" in names and models[1] not in names
        for name in (done["model"], "org/set-copy"):
            assert http.request("DELETE", "/api/delete", json={"model": name}).status_code == 200
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [models[0]]


def test_clients_that_leave_while_their_model_loads_leave_no_lease_and_the_model_serves_the_next(
    models, pool_server, monkeypatch
):
    import threading

    import httpx

    from baselm.api.store_models import StoreLoader

    may_finish = threading.Event()
    real_load = StoreLoader.load

    def slow_load(self, servable, server):
        assert may_finish.wait(60), "the test never let the load finish"
        return real_load(self, servable, server)

    monkeypatch.setattr(StoreLoader, "load", slow_load)
    server = pool_server()
    body = {"model": models[1], "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for _ in range(3):  # three clients give up while the load runs
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    may_finish.set()
    server.wait_for(lambda: server.loaded() == [models[1]], "loaded")
    entry = server.pool.entries[models[1]]
    server.wait_for(lambda: entry.num_leases == 0, "without leases")
    assert entry.num_loads == 1
    assert server.openai().completions.create(**body).choices[0].text is not None


def test_loads_and_unloads_leave_no_thread_behind(models, pool_server):
    """Each engine runs on a thread the pool reuses: MLX keeps every thread's stream (and its
    scheduler thread) after the thread ends, so one new thread a load would leave one behind."""
    import os

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    server = pool_server()
    with server.http() as http:
        ask = {"prompt": "Hi", "stream": False, "keep_alive": 0, "options": {"num_predict": 2}}
        for model in models:  # warm: the first loads start what any load needs once
            assert http.post("/api/generate", json={"model": model, **ask}).json()["done"]
        server.wait_for(lambda: server.loaded() == [], "unloaded")
        before = threads()
        for _ in range(3):
            for model in models:
                assert http.post("/api/generate", json={"model": model, **ask}).json()["done"]
            server.wait_for(lambda: server.loaded() == [], "unloaded")
        assert threads() <= before, (before, threads())
