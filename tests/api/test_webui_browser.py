"""The chat page in a real headless Chromium (Debian's `chromium` and `chromium-driver`), against a
real server on loopback: pick the model, stream an answer, stop one, edit and resend, find the
conversation after a reload, give the API key when asked, send an image picked, pasted or dropped
(to the tiny Gemma 3 with images). Screenshots go to the test's tmp dir.

Driven by Selenium through the system chromedriver: the driver is the browser's own build (one
Debian source package, always the same version) and works offline. Playwright would need its own
browser downloads, and hand-written DevTools calls over a websocket would be ours to keep.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from baselm.api.webui import build
from baselm.backend import select_backend
from baselm.loader import load_model
from baselm.sampling.defaults import SamplingDefaults
from tests.api.conftest import RunningServer
from tests.tiny_model import write_model_folder

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="no chromium or chromedriver (apt-get install chromium-driver)"
)
needs_markdown = pytest.mark.skipif(
    not build.has_files(), reason="the page's libraries are not built (npm absent; python -m baselm.api.webui.build)"
)
KEY = "sk-browser"
WAIT = 30.0  # seconds: bounds a test that would otherwise hang; nothing is timed


def _server(folder: Path, **kwargs) -> RunningServer:
    """The tiny llama without an end-of-sequence token, so answers run until stopped or max_tokens."""
    loaded = load_model(folder, select_backend("cpu"))
    sampling = SamplingDefaults(max_tokens=kwargs.pop("max_tokens", 24))
    return RunningServer(loaded=loaded, sampling=sampling, kv_memory=32 * 2**20, runaway_guard=0, **kwargs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("webui-model"), eos=False, max_position_embeddings=65536)


@pytest.fixture(scope="module")
def page_server(folder) -> Iterator[RunningServer]:
    server = _server(folder)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def long_server(folder) -> Iterator[RunningServer]:
    """Answers of up to 60,000 tokens: one runs until Stop."""
    server = _server(folder, max_tokens=60000)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(folder) -> Iterator[RunningServer]:
    server = _server(folder, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture
def browser(tmp_path) -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium (its own profile, so its own localStorage) for each test."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1100,720")
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str):
    """The first truthy value of `condition(driver)`; fails the test, naming `what`, after WAIT seconds."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.05).until(condition)
    except TimeoutException:
        pytest.fail(f"the page did not show {what} within {WAIT:g} s")


def open_page(driver, server: RunningServer) -> None:
    driver.get(server.url + "/")
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.ready === 'true'"), "itself ready")


def by_css(driver, selector: str):
    return driver.find_elements("css selector", selector)


def send(driver, text: str) -> None:
    box = by_css(driver, "#prompt")[0]
    box.send_keys(text)
    by_css(driver, "#send")[0].click()


def answers(driver) -> list[str]:
    return [element.text for element in by_css(driver, ".message.assistant .body")]


def wait_answered(driver) -> None:
    wait_for(driver, lambda d: not by_css(d, "#send")[0].get_attribute("hidden"), "the answer's end")


def test_a_message_streams_its_answer_with_its_speed(browser, page_server, tmp_path) -> None:
    open_page(browser, page_server)
    picker = by_css(browser, "#model option")
    assert [option.get_attribute("value") for option in picker] == ["tiny"]
    send(browser, "Hello there")
    wait_answered(browser)
    (answer,) = answers(browser)
    assert answer.strip()
    stats = by_css(browser, ".message.assistant .stats")[0].text
    assert "tok/s" in stats and "24 tokens" in stats and "cached)" in stats
    browser.save_screenshot(str(tmp_path / "answered.png"))


def test_stop_ends_an_answer_mid_stream(browser, long_server, tmp_path) -> None:
    open_page(browser, long_server)
    send(browser, "Tell me everything")
    wait_for(browser, lambda d: len("".join(answers(d))) > 20, "the first tokens")
    by_css(browser, "#stop")[0].click()
    wait_answered(browser)
    assert "stopped" in by_css(browser, ".message.assistant .stats")[0].text
    long_server.wait_idle()  # the server aborted the request when the page let go of it
    browser.save_screenshot(str(tmp_path / "stopped.png"))


def test_a_reload_finds_the_conversation(browser, page_server) -> None:
    open_page(browser, page_server)
    send(browser, "Remember me")
    wait_answered(browser)
    first = answers(browser)
    browser.refresh()
    open_page(browser, page_server)
    assert [e.text for e in by_css(browser, ".conversation .open")] == ["Remember me"]
    assert by_css(browser, ".message.user .body")[0].text == "Remember me" and answers(browser) == first
    by_css(browser, "#new-chat")[0].click()
    assert len(by_css(browser, ".conversation")) == 2 and not by_css(browser, ".message")
    by_css(browser, ".conversation .delete")[0].click()
    assert [e.text for e in by_css(browser, ".conversation .open")] == ["Remember me"]


def test_editing_a_message_answers_again_from_there(browser, page_server) -> None:
    open_page(browser, page_server)
    send(browser, "First question")
    wait_answered(browser)
    send(browser, "Second question")
    wait_answered(browser)
    browser.execute_script("document.querySelector('.message.user .edit').click()")
    box = by_css(browser, ".edit-box")[0]
    box.clear()
    box.send_keys("A better first question")
    by_css(browser, ".resend")[0].click()
    wait_answered(browser)
    assert [e.text for e in by_css(browser, ".message.user .body")] == ["A better first question"]
    assert len(answers(browser)) == 1


def test_the_key_is_asked_for_once_and_kept(browser, keyed_server, tmp_path) -> None:
    browser.get(keyed_server.url + "/")
    wait_for(browser, lambda d: by_css(d, "#key-dialog[open]"), "the API key prompt")
    by_css(browser, "#key-input")[0].send_keys(KEY)
    by_css(browser, "#key-save")[0].click()
    wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ready === 'true'"), "itself ready")
    assert [o.get_attribute("value") for o in by_css(browser, "#model option")] == ["tiny"]
    send(browser, "Hello with a key")
    wait_answered(browser)
    assert answers(browser)[0].strip()
    browser.refresh()
    open_page(browser, keyed_server)  # the kept key: no prompt this time
    assert not by_css(browser, "#key-dialog[open]")
    browser.save_screenshot(str(tmp_path / "keyed.png"))


MARKDOWN = "# Title\n\nSome **bold** text.\n\n```python\ndef f():\n    return 1\n```\n\n<img src=x onerror=alert(1)>"


def _show(driver, text: str) -> None:
    """Puts `text` in a saved conversation as the model's answer and opens it, as a reload would."""
    conversation = {
        "id": "c1",
        "title": "md",
        "model": "tiny",
        "updated": 1,
        "messages": [
            {"role": "user", "content": "show markdown"},
            {"role": "assistant", "content": text, "stats": None},
        ],
    }
    driver.execute_script(
        "localStorage.setItem('base.conversations', JSON.stringify([arguments[0]]));"
        "localStorage.setItem('base.current', 'c1');",
        conversation,
    )
    driver.refresh()


@needs_markdown
def test_answers_render_as_markdown_with_highlighted_code_and_no_script(browser, page_server) -> None:
    open_page(browser, page_server)
    _show(browser, MARKDOWN)
    open_page(browser, page_server)
    body = by_css(browser, ".message.assistant .body")[0]
    assert body.find_element("css selector", "h1").text == "Title"
    assert body.find_element("css selector", "strong").text == "bold"
    assert body.find_elements("css selector", "pre code.hljs .hljs-keyword")  # highlighted
    assert body.find_element("css selector", "img").get_attribute("onerror") is None  # DOMPurify's work


def test_without_the_libraries_answers_are_plain_escaped_text(browser, page_server) -> None:
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/webui/vendor/*"]})
    open_page(browser, page_server)
    _show(browser, MARKDOWN)
    open_page(browser, page_server)
    body = by_css(browser, ".message.assistant .body")[0]
    assert body.text == MARKDOWN and not body.find_elements("css selector", "h1, img")
    assert "plain text" in by_css(browser, "#notice")[0].text


# ---- images: picked, pasted or dropped, sent as image_url parts ----------------------------


@pytest.fixture(scope="module")
def vision_server() -> Iterator[RunningServer]:
    """The tiny Gemma 3 with images (tests/vision_fixture.py), greedy, as the page leaves sampling to the server."""
    from tests.vision_fixture import loaded_vlm

    server = RunningServer(
        loaded=loaded_vlm(), model_name="vlm", sampling=SamplingDefaults(temperature=0, max_tokens=8)
    )
    yield server
    server.stop()


def _pick_image(driver, path: Path) -> None:
    """Chooses `path` in the page's file input, as the Image button's file dialog would."""
    picker = by_css(driver, "#image-input")[0]
    driver.execute_script("arguments[0].hidden = false", picker)  # a hidden input takes no keys
    picker.send_keys(str(path))
    wait_for(driver, lambda d: len(by_css(d, "#attachments .thumb")) == 1, "the picked image")


_IMAGE_EVENT = """
const [kind, base64, name] = arguments;
const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
const data = new DataTransfer();
data.items.add(new File([bytes], name, {type: name.endsWith(".png") ? "image/png" : "image/jpeg"}));
const target = kind === "paste" ? document.getElementById("prompt") : document.getElementById("composer");
const event = kind === "paste"
  ? new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true})
  : new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true});
target.dispatchEvent(event);
"""


def test_an_image_picked_goes_with_the_message_as_an_image_url_part(browser, vision_server, tmp_path) -> None:
    from tests.vision_fixture import IMAGE_A, PROMPT_1, reference

    open_page(browser, vision_server)
    _pick_image(browser, IMAGE_A)
    assert by_css(browser, "#attachments .thumb")[0].get_attribute("src").startswith("data:image/png;base64,")
    send(browser, PROMPT_1)
    wait_answered(browser)
    assert not by_css(browser, "#attachments .thumb")  # sent with the message, gone from the composer
    sent = by_css(browser, ".message.user .thumb")
    assert len(sent) == 1 and sent[0].get_attribute("src").startswith("data:image/png;base64,")
    # the reference's prompt: the image placed by the chat template (16 image tokens) and its text
    stats = by_css(browser, ".message.assistant .stats")[0].text
    assert f"prompt {len(reference()['input_ids_1'])} " in stats and "8 tokens" in stats
    message = browser.execute_script("return JSON.parse(localStorage.getItem('base.conversations'))[0].messages[0]")
    assert [part["type"] for part in message["content"]] == ["image_url", "text"]
    assert message["content"][1]["text"] == PROMPT_1
    browser.save_screenshot(str(tmp_path / "image-sent.png"))


@pytest.mark.parametrize("kind", ["paste", "drop"])
def test_an_image_pasted_or_dropped_is_attached(browser, vision_server, kind) -> None:
    import base64

    from tests.vision_fixture import IMAGE_B

    open_page(browser, vision_server)
    browser.execute_script(_IMAGE_EVENT, kind, base64.b64encode(IMAGE_B.read_bytes()).decode(), IMAGE_B.name)
    wait_for(browser, lambda d: len(by_css(d, "#attachments .thumb")) == 1, f"the {kind}d image")
    assert by_css(browser, "#attachments .thumb")[0].get_attribute("src").startswith("data:image/jpeg;base64,")
    by_css(browser, "#attachments .remove")[0].click()
    assert not by_css(browser, "#attachments .thumb")


def test_a_file_that_is_no_image_the_server_reads_is_named(browser, vision_server) -> None:
    open_page(browser, vision_server)
    browser.execute_script(_IMAGE_EVENT.replace('"image/jpeg"', '"image/bmp"'), "drop", "Qk0=", "scan.bmp")
    reason = "scan.bmp is not a PNG, JPEG, WebP or GIF image"
    wait_for(browser, lambda d: reason in by_css(d, "#notice")[0].text, "why the file was not attached")
    assert not by_css(browser, "#attachments .thumb")


def test_a_text_model_answers_an_image_with_the_servers_reason(browser, page_server) -> None:
    from tests.vision_fixture import IMAGE_A

    open_page(browser, page_server)
    _pick_image(browser, IMAGE_A)
    send(browser, "What is this?")
    wait_answered(browser)
    assert "model tiny reads text only; it cannot take images" in by_css(browser, "#notice")[0].text
