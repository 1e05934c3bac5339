"""Every refusal has the OpenAI error body and the right status, and the server keeps serving."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from starlette.routing import Route

from tests.api.conftest import MODEL

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def assert_serving(server) -> None:
    response = server.http().post(CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


def test_bad_field_is_400_naming_it(server):
    http = server.http()
    error = assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": HELLO, "temperature": "hot"}), 400, "temperature"
    )
    assert error["type"] == "invalid_request_error"
    assert_error(http.post(CHAT, json={"model": MODEL, "messages": HELLO, "top_p": 1.5}), 400, "top_p")
    assert_error(http.post(CHAT, json={"model": MODEL, "messages": HELLO, "n": 0}), 400, "n")
    assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": 21}),
        400,
        "top_logprobs",
    )
    assert_error(http.post(CHAT, json={"model": MODEL, "messages": []}), 400, "messages")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400, "suffix")
    assert_serving(server)


@pytest.mark.parametrize(
    "key", ["²", "١٢", "9" * 5000, "-1", " 5"], ids=["superscript", "arabic", "long", "neg", "space"]
)
def test_a_logit_bias_key_that_is_not_a_token_id_in_ascii_digits_is_400(server, key):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1, "logit_bias": {key: 1}}
    error = assert_error(server.http().post(CHAT, json=body), 400, "logit_bias")
    assert "is not a token id" in error["message"]


def test_unknown_fields_are_refused_by_name_but_user_is_accepted(server):
    http = server.http()
    error = assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": HELLO, "temprature": 0.5}), 400, "temprature"
    )
    assert "'temprature'" in error["message"]
    assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x", "mood": 1}]}), 400, "mood"
    )
    ok = http.post(CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 1, "user": "u-1"})
    assert ok.status_code == 200


def test_a_function_name_with_a_trailing_newline_is_refused(server):
    tools = [{"type": "function", "function": {"name": "get_weather\n", "parameters": {"type": "object"}}}]
    response = server.http().post(CHAT, json={"model": MODEL, "messages": HELLO, "tools": tools})
    error = assert_error(response, 400, "tools[0].function.name")
    assert "must be 1-64 letters" in error["message"]


def test_images_for_a_text_model_audio_parts_and_unknown_roles_are_refused_clearly(server):
    http = server.http()
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    error = assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": image}), 400, "messages[0].content[0].image_url.url"
    )
    assert error["message"] == f"model {MODEL} reads text only; it cannot take images"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": audio}), 400, "messages[0].content[0].type")
    assert "text and image_url parts" in error["message"]
    assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role"
    )


def test_context_length_exceeded_says_so_in_openais_words(server):
    """litellm and langchain tell a context-window error from other 400s by OpenAI's text."""
    http = server.http()
    max_model_len = http.get(f"/v1/models/{MODEL}").json()["max_model_len"]
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}
    too_many = {"model": MODEL, "prompt": "hi", "max_tokens": max_model_len}
    for path, body in ((CHAT, long_chat), ("/v1/completions", too_many)):
        message = http.post(path, json=body).json()["error"]["message"]
        assert message.startswith(f"this model's maximum context length is {max_model_len} tokens")


def test_context_length_exceeded(server):
    http = server.http()
    long_prompt = "word " * 3000
    assert_error(
        http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}),
        400,
        "messages",
        "context_length_exceeded",
    )
    assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5000}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai().completions.create(model=MODEL, prompt=long_prompt)
    assert raised.value.code == "context_length_exceeded"
    assert_serving(server)


def test_unknown_model_and_route_are_404_and_wrong_method_405(server):
    http = server.http()
    assert_error(http.post(CHAT, json={"model": "gpt-4", "messages": HELLO}), 404, "model", "model_not_found")
    assert_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.openai().chat.completions.create(model="gpt-4", messages=HELLO)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(CHAT), 405)
    assert_error(http.delete("/v1/models"), 405)
    assert_serving(server)


def test_bad_json_and_empty_body_are_400(server):
    http = server.http()
    assert_error(
        http.post(CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}), 400
    )
    assert_error(http.post(CHAT, content=b""), 400)
    assert_error(http.post(CHAT, content=b"[1, 2]"), 400)
    assert_error(http.post(CHAT, content=b"\xff\xfe garbage"), 400)


def test_body_over_the_limit_is_413(make_server_with):
    server = make_server_with(max_body_bytes=2000)
    http = server.http()
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(http.post(CHAT, json=big), 413)

    def chunks():  # no content-length: the limit is counted while reading
        for _ in range(10):
            yield b" " * 500

    assert_error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert_serving(server)


def test_api_key_is_required_and_compared(make_server_with):
    server = make_server_with(api_key="s3cret")
    http = server.http()
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": HELLO}), 401, code="invalid_api_key")
    assert error["type"] == "authentication_error"
    assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(http.get("/v1/models", headers={"Authorization": "s3cret"}), 401)
    assert_error(http.get("/metrics"), 401)
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="nope").models.list()
    assert [m.id for m in server.openai(api_key="s3cret").models.list().data] == [MODEL]
    answer = server.openai(api_key="s3cret").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200  # probes need no key


def test_the_bearer_scheme_is_case_insensitive(make_server_with):
    http = make_server_with(api_key="s3cret").http()
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert http.get("/v1/models", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
    assert_error(http.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)


def test_a_non_ascii_key_is_compared_as_utf8(make_server_with):
    key = "clé-ключ"
    http = make_server_with(api_key=key).http()
    assert http.get("/v1/models", headers={"Authorization": b"Bearer " + key.encode()}).status_code == 200
    assert http.get("/v1/models", headers={"x-api-key": key.encode()}).status_code == 200
    assert_error(http.get("/v1/models", headers={"x-api-key": key.encode("latin-1", "replace")}), 401)


def test_a_wrong_credential_beside_the_right_one_is_refused(make_server_with):
    http = make_server_with(api_key="s3cret").http()
    right_bearer, wrong_bearer = ("authorization", "Bearer s3cret"), ("authorization", "Bearer wrong")
    right_key, wrong_key = ("x-api-key", "s3cret"), ("x-api-key", "wrong")
    for headers in ([right_key, wrong_bearer], [wrong_bearer, right_key], [right_bearer, wrong_key],
                    [wrong_key, right_bearer], [right_bearer, wrong_bearer]):  # fmt: skip
        assert_error(http.get("/v1/models", headers=headers), 401)
    assert http.get("/v1/models", headers=[right_bearer, right_key]).status_code == 200


def test_full_queue_is_429_and_clears(make_server_with):
    server = make_server_with(max_num_seqs=1, max_waiting=1)
    client = server.openai()
    long = dict(model=MODEL, messages=HELLO, max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
    running = client.chat.completions.create(**long)
    next(iter(running))  # queued: the first chunk may come before the engine runs it
    server.wait_until(lambda m: m["base_num_requests_running"] == 1, "running the first request")
    waiting_result: list = []
    waiter = threading.Thread(
        target=lambda: waiting_result.append(
            list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True))
        )
    )
    waiter.start()
    server.wait_until(lambda m: m["base_num_requests_waiting"] == 1, "holding the second request in the queue")
    response = server.http().post(CHAT, json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert_error(response, 429, code="queue_full")
    assert response.headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    running.close()  # the running request is aborted, the waiting one runs
    waiter.join(60)
    assert waiting_result and waiting_result[0][-1].choices[0].finish_reason in ("stop", "length")
    assert server.wait_idle()["base_kv_blocks_used"] == 0
    assert_serving(server)


def test_a_real_bug_is_500_without_a_traceback(make_server_with):
    server = make_server_with()

    async def broken(request):
        raise RuntimeError("secret internal detail")

    server.server.config.app.router.routes.append(Route("/broken", broken))
    error = assert_error(server.http().get("/broken"), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"
    assert_serving(server)
    counts = server.http().get("/metrics").text
    assert 'base_requests_total{endpoint="other",status="500",model=""} 1' in counts
