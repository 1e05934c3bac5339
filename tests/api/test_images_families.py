"""Images through the APIs for each vision-language family beside Gemma 3 (test_images.py): a served
fixture answers an OpenAI chat request with one image and one with two, and an Ollama chat request,
with transformers' greedy answer (the real openai and ollama clients; Ollama's default repeat
penalty turned off)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import ollama
import pytest

from tests.api.conftest import RunningServer
from tests.vision_fixture import IDEFICS3, PROMPT_1, QWEN2_5_VL, VisionFixture, data_url, messages_1, messages_2

FAMILIES = {"idefics3": IDEFICS3, "qwen2_5_vl": QWEN2_5_VL}
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, VisionFixture]]:
    fixture = FAMILIES[request.param]
    server = RunningServer(loaded=fixture.loaded(), model_name=request.param)
    yield server, fixture
    server.stop()


def expected_text(fixture: VisionFixture, tag: str) -> str:
    return fixture.loaded().tokenizer.decode(fixture.reference()[f"greedy_{tag}"].tolist(), skip_special_tokens=True)


def image_url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_chat_with_one_image(served):
    server, fixture = served
    messages = messages_1(image_url_part(data_url(fixture.paths("1")[0])))
    out = server.openai().chat.completions.create(model=server.model_name, messages=messages, **GREEDY)
    assert out.choices[0].message.content == expected_text(fixture, "1")
    assert out.usage.prompt_tokens == len(fixture.reference()["input_ids_1"])


def test_openai_chat_with_two_images(served):
    server, fixture = served
    parts = [image_url_part(data_url(p)) for p in fixture.paths("2")]
    out = server.openai().chat.completions.create(model=server.model_name, messages=messages_2(*parts), **GREEDY)
    assert out.choices[0].message.content == expected_text(fixture, "2")


def test_ollama_chat_with_an_image(served):
    server, fixture = served
    image = base64.b64encode(fixture.paths("1")[0].read_bytes()).decode()
    message = {"role": "user", "content": PROMPT_1, "images": [image]}
    out = ollama.Client(host=server.url, timeout=60).chat(
        model=server.model_name, messages=[message], options={"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
    )
    assert out.message.content == expected_text(fixture, "1")
