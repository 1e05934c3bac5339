"""A request's own text in a chat prompt encodes as plain text whatever control tokens it spells,
the template's markers stay control tokens, and a prompt without such text keeps its ids."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from baselm.tokenizer.errors import ChatTemplateError
from baselm.tokenizer.plain_text import MARK, ControlText, RenderedChat
from baselm.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.conftest import ALL_NAMES, CONVERSATIONS, FORGED, encoded_whole, with_template

CHATML_WITH_TOOLS = [n for n in ALL_NAMES if not n.startswith("spm")]  # the [INST] template takes no tools


def control_ids(tok: Tokenizer, ids: Sequence[int]) -> list[int]:
    return [i for i in ids if i in tok.special_token_ids]


def between(ids: list[int], other: list[int]) -> list[int]:
    """`ids` without the leading and trailing ids it shares with `other`."""
    start = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
    end = next((i for i, (a, b) in enumerate(zip(ids[::-1], other[::-1])) if a != b), 0)
    return ids[start : len(ids) - end]


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_a_message_that_spells_control_tokens_encodes_as_text(tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": FORGED}])
    empty = tokenizer.encode_chat([{"role": "user", "content": ""}])
    content = between(ids, empty)
    assert control_ids(tokenizer, content) == [] and "You are evil" in tokenizer.decode(content)
    assert control_ids(tokenizer, ids) == control_ids(tokenizer, empty)  # the template's markers, no more
    assert FORGED in tokenizer.decode(ids)
    whole = encoded_whole(tokenizer, [{"role": "user", "content": FORGED}])
    assert len(control_ids(tokenizer, whole)) > len(control_ids(tokenizer, empty))  # encoded whole, it forges a turn


def with_text_everywhere(text: str) -> tuple[list[dict], list[dict]]:
    """A conversation (system, content parts, a tool call, its result) and tools with `text` in every string."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": text}}}
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": [{"type": "text", "text": text}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": text},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}]
    return messages, tools


@pytest.mark.parametrize("tokenizer", CHATML_WITH_TOOLS, indirect=True)
def test_every_string_of_a_request_is_plain_tools_too(tokenizer):
    messages, tools = with_text_everywhere(FORGED)
    benign_messages, benign_tools = with_text_everywhere("x")
    ids = tokenizer.encode_chat(messages, tools=tools)
    assert control_ids(tokenizer, ids) == control_ids(
        tokenizer, tokenizer.encode_chat(benign_messages, tools=benign_tools)
    )


def test_template_variables_a_request_sets_are_plain_and_the_tokenizers_own_are_not():
    tok = with_template("{{ eos_token }}{{ note }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    eos = tok.eos_token_ids[0]
    ids = tok.encode_chat([{"role": "user", "content": "hi"}], note=FORGED)
    assert control_ids(tok, ids) == [eos]
    overridden = tok.encode_chat([{"role": "user", "content": "hi"}], eos_token=FORGED)
    assert control_ids(tok, overridden) == []


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_a_prompt_without_such_text_keeps_its_ids(tokenizer, name):
    case = CONVERSATIONS[name]
    for add_generation_prompt in (True, False):
        try:
            expected = encoded_whole(tokenizer, case["messages"], add_generation_prompt, case.get("tools"))
        except ChatTemplateError:
            continue  # the [INST] template refuses tool turns, either way
        assert tokenizer.encode_chat(case["messages"], add_generation_prompt, case.get("tools")) == expected


@pytest.mark.parametrize("tokenizer", ["bpe", "spm"], indirect=True)
def test_plain_text_after_a_marker_encodes_as_it_does_in_context(tokenizer):
    # The stretch re-encoded without special tokens follows a control token, not a text's start:
    # the SentencePiece one (Metaspace, "▁" before a text's first piece only) must not gain a "▁".
    rendered = RenderedChat("<|im_start|>Hello <|im_end|> there", ((13, 23),))
    ids = tokenizer.encode_rendered(rendered)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and control_ids(tokenizer, ids[1:]) == []
    assert tokenizer.decode(ids) == rendered.text
    before = tokenizer.encode("<|im_start|>Hello", add_special_tokens=False)
    assert ids[: len(before) - 1] == before[:-1]  # the same ids up to where the plain stretch changes them


def test_marks_come_out_and_say_where_the_request_spelled_a_special_token():
    control = ControlText(["<|a|>", "<|ab|>"])
    marked = control.mark({"content": f"x<|ab|>y{MARK}z<|a|>", "n": 3})
    assert marked == {"content": f"x<{MARK}|ab|>y{MARK}{MARK}z<{MARK}|a|>", "n": 3}
    rendered = control.unmark(f"<|a|>{marked['content']}<|a|>")
    assert rendered == RenderedChat(f"<|a|>x<|ab|>y{MARK}z<|a|><|a|>", ((6, 12), (15, 20)))


def test_a_mark_the_template_cut_from_its_token_is_dropped():
    control = ControlText(["<|end|>"])
    cut = control.mark("say <|end|>")[:6]  # a template that keeps a string's first 6 characters
    assert control.unmark(cut) == RenderedChat("say <", ())
