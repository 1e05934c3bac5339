"""POST /v1/chat/completions through the official openai client against a real server."""

from __future__ import annotations

from baselm.sampling.params import SamplingParams
from tests.api.conftest import MODEL

HELLO = [{"role": "user", "content": "Hello there"}]


def _chat(server, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return server.openai().chat.completions.create(model=MODEL, **kwargs)


def _stream_text(server, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(_chat(server, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_greedy_answer_matches_the_engine_on_the_same_prompt(server):
    response = _chat(server, max_tokens=12, temperature=0)
    prompt_ids = server.engine.tokenizer.encode_chat(HELLO, add_generation_prompt=True)
    tokens = server.http().post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    assert tokens == prompt_ids
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt_ids) + 12
    detok = server.http().post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert detok.endswith("<|im_start|>assistant\n")

    def generate(engine, ids):  # on the engine's own thread, with nothing else in flight
        return engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0].completions[0].text

    assert choice.message.content == server.client.call(generate, prompt_ids).result(60)


def test_stream_reassembles_to_the_whole_answer(server):
    whole = _chat(server, max_tokens=16, temperature=0)
    texts, reasons, chunks = _stream_text(server, max_tokens=16, temperature=0)
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices[0].delta.content is None


def test_include_usage_adds_a_final_chunk_with_empty_choices(server):
    whole = _chat(server, max_tokens=5, temperature=0)
    _, _, chunks = _stream_text(server, max_tokens=5, temperature=0, stream_options={"include_usage": True})
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_n_copies_are_indexed_and_greedy_copies_agree(server):
    response = _chat(server, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) == 1
    assert response.usage.completion_tokens == 24
    texts, reasons, _ = _stream_text(server, max_tokens=8, temperature=0, n=3)
    assert texts == {i: response.choices[0].message.content for i in range(3)}
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_seed_reproduces_sampled_answers_and_copies_differ(server):
    first = _chat(server, max_tokens=12, temperature=1.0, seed=1234, n=2)
    second = _chat(server, max_tokens=12, temperature=1.0, seed=1234, n=2)
    other = _chat(server, max_tokens=12, temperature=1.0, seed=99, n=2)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert [c.message.content for c in first.choices] != [c.message.content for c in other.choices]


def test_stop_string_ends_the_answer_before_it(server):
    full = _chat(server, max_tokens=24, temperature=0).choices[0].message.content
    stop = full[5:7]
    cut = _chat(server, max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index(stop)]
    texts, reasons, _ = _stream_text(server, max_tokens=24, temperature=0, stop=stop)
    assert texts == {0: cut.message.content} and reasons == {0: "stop"}


def test_logprobs_give_the_chosen_token_and_sorted_alternatives(server):
    response = _chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy picks the best
        assert entry.logprob <= 0.0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [
        e
        for chunk in _chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        for c in chunk.choices
        if c.logprobs
        for e in c.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_max_completion_tokens_and_min_tokens_with_ignore_eos(server):
    response = _chat(server, max_completion_tokens=7, temperature=0)
    assert response.usage.completion_tokens == 7
    forced = _chat(
        server,
        max_tokens=9,
        temperature=0,
        extra_body={"min_tokens": 9, "ignore_eos": True, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    assert forced.usage.completion_tokens == 9 and forced.choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(server):
    token_id = server.engine.tokenizer.token_to_id("Z")
    response = _chat(server, max_tokens=4, temperature=0, logit_bias={str(token_id): 100})
    assert response.choices[0].message.content == "ZZZZ"


def test_penalties_change_a_greedy_answer(server):
    plain = _chat(server, max_tokens=20, temperature=0).choices[0].message.content
    penalised = _chat(server, max_tokens=20, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != plain


def test_content_parts_system_developer_and_tool_history(server):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = _chat(server, messages=messages, max_tokens=3, temperature=0, user="someone")
    text = (
        server.http()
        .post(
            "/detokenize",
            json={"tokens": server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]},
        )
        .json()["prompt"]
    )
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?In Paris.<|im_end|>")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert response.usage.completion_tokens == 3


def test_continue_final_message_continues_the_assistant_text(server):
    messages = [*HELLO, {"role": "assistant", "content": "Well, "}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    response = _chat(server, messages=messages, max_tokens=6, temperature=0, extra_body=prefill)
    prompt_ids = server.engine.tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    detok = server.http().post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert detok.endswith("<|im_start|>assistant\nWell, ")
    assert response.usage.prompt_tokens == len(prompt_ids)

    def generate(engine, ids):  # on the engine's own thread, with nothing else in flight
        return engine.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0].completions[0].text

    assert response.choices[0].message.content == server.client.call(generate, prompt_ids).result(60)
    # continue_final_message alone turns the generation prompt off
    alone = _chat(server, messages=messages, max_tokens=6, temperature=0, extra_body={"continue_final_message": True})
    assert alone.choices[0].message.content == response.choices[0].message.content


def test_add_generation_prompt_false_leaves_the_assistant_header_out(server):
    response = _chat(server, max_tokens=2, temperature=0, extra_body={"add_generation_prompt": False})
    assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode_chat(HELLO, add_generation_prompt=False))
    assert response.usage.prompt_tokens < len(server.engine.tokenizer.encode_chat(HELLO))


def test_continue_final_message_needs_a_final_assistant_message_and_no_generation_prompt(server):
    http = server.http()
    body = {"model": MODEL, "messages": HELLO, "continue_final_message": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "assistant" in response.json()["error"]["message"]
    body["messages"] = [*HELLO, {"role": "assistant", "content": "Hi"}]
    response = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


def test_models_lists_the_served_model(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.openai().models.retrieve(MODEL).id == MODEL
    assert server.http().get("/health").json() == {"status": "ok"}
