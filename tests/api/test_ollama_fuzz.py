"""Hundreds of malformed bodies (fixed seed) on Ollama's routes and /v1/embeddings: each a 4xx in that
API's error shape, never a 500, and the server answers a good request afterwards."""

from __future__ import annotations

import copy
import random

from tests.api.conftest import MODEL
from tests.api.test_errors import assert_serving

WRONG = [None, True, "text", -1, 10**30, 1.5e308, [], {}, [1, "a"], {"a": {"b": []}}, "", 0.5]
GOOD = {
    "/api/chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 2}},
    "/api/generate": {"model": MODEL, "prompt": "Hi", "options": {"num_predict": 2}},
    "/api/embed": {"model": MODEL, "input": ["Hi"]},
    "/api/embeddings": {"model": MODEL, "prompt": "Hi"},
    "/api/show": {"model": MODEL},
    "/v1/embeddings": {"model": MODEL, "input": "Hi"},
}
SPECIAL = {
    "messages": [
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{}],
        [{"role": "user", "images": ["x"]}],
    ],
    "options": [
        {"temperature": "hot"},
        {"top_p": -1},
        {"num_predict": "x"},
        {"stop": "x"},
        {"no_option": 1},
        {"seed": 1.5},
    ],
    "format": ["xml", 5, []],
    "input": [[], [5, "a"], [[]], [None]],
    "context": [["a"], "x", [True]],
    "tools": [[{"type": "other"}], [{"function": {}}], "x"],
    "think": [5, []],
}


def _mutations(rng: random.Random) -> list[tuple[str, dict]]:
    cases = []
    for path, good in GOOD.items():
        for field in [*good, "no_such_field", *[f for f in SPECIAL if rng.random() < 0.6]]:
            for value in rng.sample(WRONG, 5) + SPECIAL.get(field, []):
                body = copy.deepcopy(good)
                body[field] = value
                cases.append((path, body))
        cases.append((path, {}))
        cases.append((path, []))
    return cases


def test_malformed_bodies_get_4xx_in_their_apis_shape(server) -> None:
    rng = random.Random(1234)
    http = server.http()
    cases = _mutations(rng)
    assert len(cases) >= 200
    statuses = []
    for path, body in cases:
        response = http.post(path, json=body)
        statuses.append(response.status_code)
        assert response.status_code < 500, (path, body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            if path.startswith("/api/"):
                assert isinstance(error, str) and error, (path, body)
            else:
                assert isinstance(error, dict) and error["message"], (path, body)
    assert sum(s >= 400 for s in statuses) >= 200
    for path in ("/api/chat", "/api/generate"):
        raw = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert raw.status_code == 400 and isinstance(raw.json()["error"], str)
    server.wait_idle()
    assert_serving(server)
