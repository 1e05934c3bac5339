"""A server started with its one model (`base serve MODEL`, `make_server`): the model is pinned,
listed as loaded by the router endpoints, and no request unloads it."""

from __future__ import annotations

from tests.api.conftest import MODEL


def test_the_model_a_server_was_started_with_stays_loaded(server):
    http = server.http()
    assert [(m["id"], m["status"]["value"]) for m in http.get("/models").json()["data"]] == [(MODEL, "loaded")]
    refused = http.post("/models/unload", json={"model": MODEL})
    assert refused.status_code == 400 and "stays loaded" in refused.json()["error"]["message"]
    empty = http.post("/api/chat", json={"model": MODEL, "messages": [], "keep_alive": 0}).json()
    assert empty["done_reason"] == "load"
    (running,) = http.get("/api/ps").json()["models"]
    assert running["name"] == MODEL
