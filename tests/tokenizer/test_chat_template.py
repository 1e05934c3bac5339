"""Chat templates render like transformers' in a sandbox; refusals and bad templates are clear errors."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from baselm.tokenizer.errors import ChatTemplateError
from baselm.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.conftest import (
    ALL_NAMES,
    CONVERSATIONS,
    EXPECTED,
    expected,
    load,
    render,
    with_template,
)


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_chat_template_renders_like_transformers(tokenizer, request):
    name_of_tokenizer = request.node.callspec.params["tokenizer"]
    want = expected(name_of_tokenizer)["chat"]
    for name, case in CONVERSATIONS.items():
        if "error" in want[name] or name == "content_parts":
            continue
        assert render(tokenizer, case) == want[name]["text"], name
        ids = tokenizer.encode_chat(
            case["messages"], add_generation_prompt=case.get("add_generation_prompt", True), tools=case.get("tools")
        )
        assert ids == want[name]["ids"], name


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_conversations_transformers_refuses_raise_chat_template_error(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])["chat"]
    # content parts and null content (tool_call) have tests of their own: both render where transformers fails
    refused = [n for n in CONVERSATIONS if "error" in want[n] and n not in ("content_parts", "tool_call")]
    for name in refused:
        with pytest.raises(ChatTemplateError):
            render(tokenizer, CONVERSATIONS[name])


def test_template_raise_exception_message_reaches_the_caller():
    case = CONVERSATIONS["tool_role"]  # user, assistant, tool: the [INST] template wants alternation
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate user/assistant"):
        render(load("spm"), case)


def test_content_parts_pass_to_templates_that_iterate_them():
    case = CONVERSATIONS["content_parts"]
    assert render(load("bpe"), case) == EXPECTED["tokenizers"]["bpe"]["chat"]["content_parts"]["text"]


def test_content_parts_are_joined_for_string_only_templates(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    parts = CONVERSATIONS["content_parts"]["messages"]
    joined = [{"role": "user", "content": "Part one. \nPart two."}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(joined)
    tail = "<|im_start|>user\nPart one. \nPart two.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(joined).endswith(tail)


def test_tool_call_arguments_as_json_string_render_like_a_dict():
    case = json.loads(json.dumps(CONVERSATIONS["tool_call"]))
    case["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert render(load("bpe"), case) == EXPECTED["tokenizers"]["bpe"]["chat"]["tool_call"]["text"]


def test_template_helpers_strftime_now_generation_tag_and_tojson():
    tok = with_template(
        "{{ strftime_now('%Y') }}|{% generation %}{{ messages[0].content }}{% endgeneration %}|"
        "{{ {'k': 'é', 'n': [1]} | tojson(indent=1) }}|{{ bos_token }}{{ eos_token }}"
    )
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert text == f'{datetime.now().year}|x|{{\n "k": "é",\n "n": [\n  1\n ]\n}}|<|endoftext|><|im_end|>'


def test_template_variables_from_extra_arguments():
    tok = with_template("{% if enable_thinking %}think{% else %}plain{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=True) == "think"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


def test_templates_run_sandboxed_and_cannot_mutate_messages():
    tok = with_template("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="failed on this conversation"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_invalid_template_and_missing_template_are_clear_errors():
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        with_template("{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config.pop("chat_template")
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


def test_named_templates_pick_tool_use_when_tools_are_given():
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config["chat_template"] = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools"


def test_templates_that_only_type_test_content_get_joined_text():
    # Some templates render '' for non-string content; only a loop over content takes parts.
    tok = with_template(
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}?{% endif %}{% endfor %}"
    )
    assert tok.apply_chat_template(CONVERSATIONS["content_parts"]["messages"]) == "Part one. \nPart two."


def test_templates_that_loop_over_content_through_a_variable_get_parts():
    tok = with_template(
        "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endfor %}"
    )
    assert tok.apply_chat_template(CONVERSATIONS["content_parts"]["messages"]) == "[Part one. ][Part two.]"


def test_named_templates_given_as_the_chat_template_argument_are_picked_by_name():
    # A .base header carries an HF folder's template as the config had it: possibly a named list.
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config.pop("chat_template")
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = Tokenizer.from_hf_files(tokenizer_json, config, named)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def test_null_content_is_left_out_as_transformers_leaves_it_out():
    tok = with_template("{% for m in messages %}[{{ 'absent' if m.content is undefined else m.content }}]{% endfor %}")
    assert tok.apply_chat_template(TOOL_TURN, add_generation_prompt=False) == "[Weather in Paris?][absent][sunny]"


def test_null_content_renders_as_empty_text_in_templates_that_fail_without_it(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)  # its template writes '...' + message['content'] + '...'
    assert "error" in EXPECTED["smollm2"]["chat"]["tool_call"]  # transformers refuses it
    empty = [TOOL_TURN[0], {**TOOL_TURN[1], "content": ""}, TOOL_TURN[2]]
    assert tok.apply_chat_template(TOOL_TURN) == tok.apply_chat_template(empty)
    assert "<|im_start|>assistant\n<|im_end|>" in tok.apply_chat_template(TOOL_TURN)


def test_continue_final_message_ends_the_prompt_inside_the_last_message(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is "}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nIt is ")
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert full == text + "<|im_end|>\n"


def test_continue_final_message_refuses_a_message_the_template_drops():
    tok = with_template("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    with pytest.raises(ChatTemplateError, match="final message does not appear"):
        tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
