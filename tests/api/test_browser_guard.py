"""What a web page may not make a keyless server on loopback do: it is refused by the Host it names
(DNS rebinding), the Origin it comes from, and a body that is not declared JSON, before any route runs."""

from __future__ import annotations

import pytest

from tests.api.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_a_foreign_host_is_refused_in_each_apis_error_shape(server):
    http = server.http(headers={"Host": f"evil.example:{server.port}"})
    openai_answer = http.post("/v1/chat/completions", json=CHAT)
    assert openai_answer.status_code == 403
    error = openai_answer.json()["error"]
    assert error["type"] == "permission_error"
    assert error["message"] == (
        "the Host header 'evil.example' is not this server's address; "
        "start it with --allowed-hosts evil.example to accept that name"
    )
    shown = http.post("/api/show", json={"model": MODEL})
    assert shown.status_code == 403 and shown.json()["error"].startswith("the Host header 'evil.example'")
    assert http.post("/v1/messages", json=CHAT).json()["type"] == "error"


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "127.0.0.1:9", "[::1]", "[::1]:8080"])
def test_loopback_names_with_any_port_are_this_server(server, host):
    answer = server.http(headers={"Host": host}).get("/v1/models")
    assert answer.status_code == 200


@pytest.mark.parametrize("host", ["localhost.evil.example", "127.0.0.1.nip.io", "notlocalhost:80", "[::2]"])
def test_names_that_only_look_like_loopback_are_refused(server, host):
    assert server.http(headers={"Host": host}).get("/v1/models").status_code == 403


def test_allowed_hosts_adds_names_and_star_allows_any(make_server_with):
    served = make_server_with(allowed_hosts=("box.lan",))
    assert served.http(headers={"Host": "box.lan:8080"}).get("/v1/models").status_code == 200
    assert served.http(headers={"Host": "localhost"}).get("/v1/models").status_code == 200
    assert served.http(headers={"Host": "other.lan"}).get("/v1/models").status_code == 403
    anything = make_server_with(allowed_hosts=("*",))
    assert anything.http(headers={"Host": "other.lan"}).get("/v1/models").status_code == 200


def test_a_server_bound_to_every_interface_accepts_any_host_by_default(make_server_with):
    """Binding 0.0.0.0 exposes the server on purpose; an API key guards it, not the Host name."""
    served = make_server_with(host="0.0.0.0")
    assert served.http(headers={"Host": "192.168.1.20:8080"}).get("/v1/models").status_code == 200


SIMPLE_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"]


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/pull", "/api/chat", "/tokenize"])
def test_a_body_a_page_can_send_without_a_preflight_is_refused(server, path, content_type):
    answer = server.http().post(path, content=b'{"model": "org/name"}', headers={"Content-Type": content_type})
    assert answer.status_code == 415
    message = answer.json()["error"]
    message = message if isinstance(message, str) else message["message"]
    assert message == f"the request body is {content_type.split(';')[0]}; send it as Content-Type: application/json"


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON", None]
)
def test_json_and_an_undeclared_body_are_read(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    answer = server.http().post("/tokenize", content=b'{"prompt": "hi"}', headers=headers)
    assert answer.status_code == 200 and answer.json()["count"] > 0


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:3000"])
def test_a_request_from_another_origin_is_refused_before_the_route_runs(server, origin):
    http = server.http(headers={"Origin": origin})
    answer = http.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 403
    assert answer.json()["error"]["message"] == (
        f"requests from the web page at {origin} are refused; start the server with --cors-origins {origin} "
        "to let that page call it"
    )
    assert http.get("/v1/models").status_code == 403
    assert server.wait_idle()


def test_the_servers_own_origin_is_not_foreign(server):
    answer = server.http(headers={"Origin": server.url}).post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200


def test_show_names_the_model_and_never_a_file_path(server):
    answer = server.http().post("/api/show", json={"model": MODEL})
    assert answer.status_code == 200
    shown = answer.json()
    assert shown["modelfile"] == f"# served by base\nFROM {MODEL}\n"
    assert str(server.engine.loaded.path) not in answer.text
