"""A reasoning model's thinking, served apart from its answer: chat completions' reasoning_content,
Responses' reasoning items, Messages' thinking blocks.

The server runs the tiny llama with a template whose generation prompt opens `<think>` (as
DeepSeek-R1's does) unless `enable_thinking` is false. A bias toward `</think>` (id 701) makes
the random model close its thinking somewhere; the same request through /v1/completions on the
same prompt ids gives the raw text the split must come from."""

from __future__ import annotations

import anthropic
import pytest

from tests.api.conftest import MODEL, RunningServer
from tests.tiny_model import loaded_thinking_llama

HELLO = [{"role": "user", "content": "Hello there"}]
CLOSES = {"max_tokens": 40, "temperature": 1.0, "seed": 1, "logit_bias": {"701": 4}}  # closes </think> mid-answer


@pytest.fixture(scope="module")
def thinking_server():
    running = RunningServer(loaded=loaded_thinking_llama(MODEL))
    yield running
    running.stop()


def _raw(server, messages, **kwargs) -> str:
    """The model's raw text for the chat prompt of `messages`, through /v1/completions."""
    variables = kwargs.pop("chat_template_kwargs", {})
    ids = server.engine.tokenizer.encode_chat(messages, **variables)
    return server.openai().completions.create(model=MODEL, prompt=ids, **kwargs).choices[0].text


def test_chat_reasoning_content_is_the_text_before_think_close(thinking_server):
    raw = _raw(thinking_server, HELLO, **CLOSES)
    assert "</think>" in raw  # the bias made the model close its thinking
    thinking, answer = raw.split("</think>", 1)
    message = thinking_server.openai().chat.completions.create(model=MODEL, messages=HELLO, **CLOSES).choices[0].message
    assert message.reasoning_content == thinking and thinking
    assert message.content == answer.lstrip()


def test_streamed_reasoning_and_content_deltas_join_to_the_whole(thinking_server):
    client = thinking_server.openai()
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, **CLOSES).choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **CLOSES):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_enable_thinking_false_reaches_the_template(thinking_server):
    kwargs = {"max_tokens": 12, "temperature": 0}
    off = {"enable_thinking": False}
    message = (
        thinking_server.openai()
        .chat.completions.create(model=MODEL, messages=HELLO, extra_body={"chat_template_kwargs": off}, **kwargs)
        .choices[0]
        .message
    )
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == _raw(thinking_server, HELLO, chat_template_kwargs=off, **kwargs)
    prompt = thinking_server.engine.tokenizer.apply_chat_template(HELLO, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_are_checked(thinking_server):
    http = thinking_server.http()
    for bad in ([1], {"messages": []}, {"not a name": 1}):
        body = {"model": MODEL, "messages": HELLO, "chat_template_kwargs": bad}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def test_responses_reasoning_item_matches_chat(thinking_server):
    client = thinking_server.openai()
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0).choices[0].message
    response = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=16, temperature=0)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.reasoning_content
    assert response.output_text == (chat.content or "")
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(model=MODEL, input="Hello there", max_output_tokens=16, temperature=0, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == chat.reasoning_content
    assert events[-1].response.output[0].content[0].text == deltas
    off = client.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=4, temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in off.output] == ["message"]


def test_messages_thinking_block_matches_chat(thinking_server):
    chat = (
        thinking_server.openai()
        .chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
        .choices[0]
        .message
    )
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0)
    message = client.messages.create(model=MODEL, messages=HELLO, max_tokens=16, extra_body={"temperature": 0})
    assert message.content[0].type == "thinking" and message.content[0].thinking == chat.reasoning_content
    with client.messages.stream(model=MODEL, messages=HELLO, max_tokens=16, extra_body={"temperature": 0}) as stream:
        deltas = "".join(
            e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        )
    assert deltas == chat.reasoning_content
    off = client.messages.create(
        model=MODEL, messages=HELLO, max_tokens=4, thinking={"type": "disabled"}, extra_body={"temperature": 0}
    )
    assert [block.type for block in off.content] == ["text"]
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking={"type": "disabled"})
    assert counted.input_tokens == len(thinking_server.engine.tokenizer.encode_chat(HELLO, enable_thinking=False))


def test_past_reasoning_content_is_accepted_in_chat_history(thinking_server):
    history = [*HELLO, {"role": "assistant", "content": "Hi!", "reasoning_content": "A greeting."}, *HELLO]
    response = thinking_server.http().post(
        "/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text


def test_ollama_chat_returns_the_thinking_chat_completions_returns(thinking_server):
    import ollama

    options = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 16}
    answer = ollama.Client(host=thinking_server.url).chat(model=MODEL, messages=HELLO, options=options)
    expected = (
        thinking_server.openai()
        .chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=16)
        .choices[0]
        .message
    )
    assert answer.message.thinking == expected.reasoning_content and answer.message.thinking
    assert answer.message.content == expected.content
    assert "<think>" not in answer.message.content
