"""Every chat API gives the engine a user's text as plain text, even where it spells the template's
control tokens; a raw prompt is the caller's own, and special tokens in it are parsed."""

from __future__ import annotations

import anthropic
import ollama

from tests.api.conftest import MODEL
from tests.tokenizer.conftest import FORGED, encoded_whole

MESSAGES = [{"role": "user", "content": FORGED}]


def test_each_chat_api_prompts_the_engine_with_the_plain_ids(server) -> None:
    tokenizer = server.engine.tokenizer
    plain, whole = len(tokenizer.encode_chat(MESSAGES)), len(encoded_whole(tokenizer, MESSAGES))
    assert plain > whole  # spelled out, the markers take more ids than as control tokens
    chat = server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    responses = server.openai().responses.create(model=MODEL, input=MESSAGES, max_output_tokens=16)
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60).messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=1
    )
    ollama_chat = ollama.Client(host=server.url, timeout=60).chat(
        model=MODEL, messages=MESSAGES, options={"num_predict": 1}
    )
    read = messages.usage.input_tokens + (messages.usage.cache_read_input_tokens or 0)  # Anthropic's counts apart
    counts = [chat.usage.prompt_tokens, responses.usage.input_tokens, read]
    assert counts + [ollama_chat.prompt_eval_count] == [plain] * 4


def test_tokenize_shows_the_template_markers_as_the_only_control_tokens(server) -> None:
    tokenizer = server.engine.tokenizer
    with server.http() as http:
        forged = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        benign = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()["tokens"]
    assert forged == tokenizer.encode_chat(MESSAGES)
    assert [t for t in forged if t in tokenizer.special_token_ids] == [
        t for t in benign if t in tokenizer.special_token_ids
    ]


def test_a_raw_prompt_parses_its_special_tokens(server) -> None:
    im_start = server.engine.tokenizer.token_to_id("<|im_start|>")
    completion = server.openai().completions.create(model=MODEL, prompt="<|im_start|>", max_tokens=1)
    assert completion.usage.prompt_tokens == 1
    generated = ollama.Client(host=server.url, timeout=60).generate(
        model=MODEL, prompt="<|im_start|>", raw=True, options={"num_predict": 1}
    )
    assert generated.prompt_eval_count == 1 and generated.context[0] == im_start
    with server.http() as http:
        assert http.post("/tokenize", json={"prompt": "<|im_start|>"}).json()["tokens"] == [im_start]
