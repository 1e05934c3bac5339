"""What clients written for llama.cpp, vLLM and SGLang send and read: accepted, and answered clearly."""

from __future__ import annotations

import json
import re

from tests.api.conftest import MODEL

ASK = [{"role": "user", "content": "Hi"}]


def _post(server, **body):
    return server.http().post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})


def test_json_object_with_a_schema_and_json_schema_without_a_name_are_enforced(server):
    for response_format in (
        {"type": "json_object", "schema": {"const": "42"}},  # llama.cpp's form
        {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}},
    ):
        response = _post(server, max_tokens=8, temperature=1.0, seed=3, response_format=response_format)
        assert response.status_code == 200, response.json()
        assert json.loads(response.json()["choices"][0]["message"]["content"]) == "42"
    response = _post(server, response_format={"type": "json_object", "schema": 7})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_tokenize_takes_llama_cpps_content_field(server):
    http = server.http()
    assert (
        http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
        == (http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"])
    )


def test_model_cards_name_their_root(server):
    card = server.http().get(f"/v1/models/{MODEL}").json()
    assert card["root"] == MODEL and card["max_model_len"] > 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def test_a_tool_choice_naming_an_unknown_tool_says_which_tools_there_are(server):
    response = _post(server, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Tool 'nope' not found in tools list; tool_choice must name one of: f"


def test_a_forced_tool_whose_schema_cannot_be_enforced_is_named(server):
    bad = {"type": "function", "function": {"name": "g", "parameters": {"properties": {"x": {"type": "nonsense"}}}}}
    response = _post(server, tools=[TOOL, bad], tool_choice="required")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[1].function.parameters"
    assert error["message"].startswith("invalid 'parameters' schema in tools[1].function.parameters (g): ")


def test_regex_shapes_the_answer_and_a_bad_one_is_a_400(server):
    for seed in range(3):
        response = _post(server, max_tokens=20, temperature=1.0, seed=seed, regex=r"(yes|no), [0-9]{1,3}")
        content = response.json()["choices"][0]["message"]["content"]
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", content), content
    response = _post(server, regex="(unclosed")
    assert response.status_code == 400 and response.json()["error"]["param"] == "regex"
    response = _post(server, regex="a", response_format={"type": "json_object"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "regex"
