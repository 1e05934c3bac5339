"""Images in chat requests on every API, through the real clients, against a served Gemma 3 fixture.

Each API's image shape reaches the one chat core (api/images.py), so the same picture and words
give the same greedy answer as transformers' (tests/vision_fixture.py's reference) on every
protocol; requests the server cannot serve get a 400 naming the field, never a 500.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator

import anthropic
import httpx
import ollama
import pytest
from PIL import Image as PILImage

from tests.api.conftest import RunningServer
from tests.vision_fixture import (
    IMAGE_A,
    IMAGE_B,
    PROMPT_1,
    data_url,
    loaded_vlm,
    messages_1,
    messages_2,
    png_declaring,
    reference,
)

VLM = "vlm"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def vlm() -> Iterator[RunningServer]:
    server = RunningServer(loaded=loaded_vlm(), model_name=VLM, allow_image_urls=True)
    yield server
    server.stop()


def expected_text(tag: str) -> str:
    return loaded_vlm().tokenizer.decode(reference()[f"greedy_{tag}"].tolist(), skip_special_tokens=True)


def image_url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def b64(path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


# ---- one answer on every API ------------------------------------------------------------


def test_openai_chat_image_url_part_gives_transformers_greedy_answer(vlm):
    out = vlm.openai().chat.completions.create(
        model=VLM, messages=messages_1(image_url_part(data_url(IMAGE_A))), **GREEDY
    )
    assert out.choices[0].message.content == expected_text("1")
    assert out.usage.prompt_tokens == len(reference()["input_ids_1"])


def test_openai_chat_two_images_in_one_message(vlm):
    parts = image_url_part(data_url(IMAGE_A)), image_url_part(data_url(IMAGE_B))
    out = vlm.openai().chat.completions.create(model=VLM, messages=messages_2(*parts), **GREEDY)
    assert out.choices[0].message.content == expected_text("2")
    assert out.usage.prompt_tokens == len(reference()["input_ids_2"])


def test_openai_responses_input_image(vlm):
    content = [{"type": "input_image", "image_url": data_url(IMAGE_A)}, {"type": "input_text", "text": PROMPT_1}]
    out = vlm.openai().responses.create(
        model=VLM, input=[{"role": "user", "content": content}], temperature=0, max_output_tokens=8
    )
    assert out.output_text == expected_text("1")


def test_anthropic_base64_image_block(vlm):
    client = anthropic.Anthropic(base_url=vlm.url, api_key="none", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(IMAGE_A)}}
    out = client.messages.create(model=VLM, messages=messages_1(image), max_tokens=8, extra_body={"temperature": 0})
    assert out.content[0].text == expected_text("1")
    # Anthropic counts prefix-cache reads apart from input_tokens.
    usage = out.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(reference()["input_ids_1"])


def test_ollama_chat_images_come_before_the_text(vlm):
    client = ollama.Client(host=vlm.url, timeout=60)
    message = {"role": "user", "content": PROMPT_1, "images": [b64(IMAGE_A)]}
    out = client.chat(model=VLM, messages=[message], options={"temperature": 0, "num_predict": 8})
    assert out.message.content == expected_text("1")


def test_ollama_generate_images(vlm):
    client = ollama.Client(host=vlm.url, timeout=60)
    out = client.generate(
        model=VLM, prompt=PROMPT_1, images=[b64(IMAGE_A)], options={"temperature": 0, "num_predict": 8}
    )
    assert out.response == expected_text("1")


def test_http_image_url_is_fetched_when_allowed(vlm):
    with _serve_files() as base:
        messages = messages_1(image_url_part(f"{base}/{IMAGE_A.name}"))
        out = vlm.openai().chat.completions.create(model=VLM, messages=messages, **GREEDY)
    assert out.choices[0].message.content == expected_text("1")


# ---- the prefix cache keys blocks by the image --------------------------------------------


def test_same_image_next_time_is_a_prefix_hit_and_another_image_is_not(vlm):
    client = vlm.openai()
    first_url, other_url = _solid_png((200, 40, 40)), _solid_png((40, 40, 200))  # images no other test sends

    def cached(url: str):
        out = client.chat.completions.create(model=VLM, messages=messages_1(image_url_part(url)), **GREEDY)
        return out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens

    num_prompt, _ = cached(first_url)
    _, again = cached(first_url)
    _, other = cached(other_url)
    image_start = list(reference()["input_ids_1"]).index(8)  # the prompt's first image token
    block = vlm.engine.config.block_size
    assert again == (num_prompt - 1) // block * block  # every block before the last token
    assert other == image_start // block * block  # the blocks before the image only


def _solid_png(rgb: tuple[int, int, int]) -> str:
    picture = PILImage.new("RGB", (20, 20), rgb)
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


# ---- refusals --------------------------------------------------------------------------


def _post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _chat_with(server: RunningServer, url: str, model: str = VLM) -> httpx.Response:
    return _post(
        server, "/v1/chat/completions", {"model": model, "messages": messages_1(image_url_part(url)), "max_tokens": 2}
    )


def test_text_only_model_refuses_images_naming_the_model(server):
    response = _chat_with(server, data_url(IMAGE_A), model=server.model_name)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"model {server.model_name} reads text only; it cannot take images"


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"not an image at all", "could not be read as PNG, JPEG, WebP or GIF"),
        (IMAGE_A.read_bytes()[:200], "could not be read as PNG, JPEG, WebP or GIF"),  # truncated
        (png_declaring(7_000, 7_000), "declares 7000x7000 pixels; images are limited to 40000000 pixels"),
        (png_declaring(60_000, 60_000), "declares too many pixels; images are limited to 40000000 pixels"),
        (b"BM" + bytes(100), "could not be read as PNG, JPEG, WebP or GIF"),  # a BMP header: not a format read here
        (b"", "is empty"),
    ],
    ids=["garbage", "truncated", "large", "bomb", "bmp", "empty"],
)
def test_unreadable_images_are_400s_naming_the_part(vlm, payload, words):
    response = _chat_with(vlm, "data:image/png;base64," + base64.b64encode(payload).decode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0].image_url.url"
    assert words in error["message"]


def test_bad_base64_and_urls_are_400s(vlm):
    cases = {
        "data:image/png;base64,@@@@": "is not valid base64",
        "data:text/plain;base64,aGk=": "must be a base64 data URL of an image",
        "ftp://example.com/a.png": "must be a data: URL or an http(s) URL of an image",
    }
    for url, words in cases.items():
        response = _chat_with(vlm, url)
        assert response.status_code == 400
        assert words in response.json()["error"]["message"], url


def test_http_image_urls_are_refused_unless_allowed(server):
    response = _chat_with(server, "http://127.0.0.1:9/a.png", model=server.model_name)
    assert response.status_code == 400  # the text-only model: refused before any fetch


def test_too_many_images_is_a_400(vlm):
    parts = [image_url_part(data_url(IMAGE_A))] * 17
    body = {"model": VLM, "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    response = _post(vlm, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request has 17 images; the limit is 16"


def test_image_outside_a_templated_place_is_a_400(vlm):
    body = {"model": VLM, "prompt": PROMPT_1, "images": [b64(IMAGE_A)], "raw": True, "stream": False}
    response = _post(vlm, "/api/generate", body)
    assert response.status_code == 400
    assert "a raw prompt takes no images" in response.json()["error"]


def test_anthropic_image_media_type_is_checked(vlm):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": b64(IMAGE_A)}}
    body = {"model": VLM, "max_tokens": 2, "messages": messages_1(image)}
    response = _post(vlm, "/v1/messages", body)
    assert response.status_code == 400
    assert "media_type" in response.json()["error"]["message"]


class _Files(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=str(IMAGE_A.parent), **kwargs)

    def log_message(self, *args) -> None:
        pass


class _serve_files:
    """The fixture folder over HTTP on loopback, for the duration of a `with`."""

    def __enter__(self) -> str:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
