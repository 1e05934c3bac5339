"""The thinking splitter: `<think>...</think>` apart from the answer, the same in any split of the text."""

from __future__ import annotations

import random

import pytest

from baselm.reasoning import ReasoningSplitter, prompt_opens_thinking, template_thinks


def split(pieces: list[str], in_thinking: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(in_thinking)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


def cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), k=min(10, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize(
    ("text", "in_thinking", "expected"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "Paris.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Let me see.\n</think>\n\nParis.", True, ("Let me see.\n", "Paris.")),
        ("Paris.", False, ("", "Paris.")),
        ("Paris <think>not thinking</think>", False, ("", "Paris <think>not thinking</think>")),
        ("<think>cut off before the end", False, ("cut off before the end", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
        ("<think>a</thi", False, ("a</thi", "")),
        ("<thin", False, ("", "<thin")),
        ("  \n", False, ("", "  \n")),
        ("<think></think>\n\n", False, ("", "")),
    ],
)
def test_split(text, in_thinking, expected):
    assert split([text], in_thinking) == expected


def test_any_split_of_the_text_gives_the_same_pieces():
    text = "<think>\nThe user asks < and > about </thinking> tags.\n</think>\n\nAnswer: <b>yes</b>"
    expected = ("\nThe user asks < and > about </thinking> tags.\n", "Answer: <b>yes</b>")
    assert split([text]) == expected
    rng = random.Random(7)
    for _ in range(100):
        assert split(cuts(text, rng)) == expected
    assert split(list(text)) == expected


def test_held_back_text_is_only_what_may_still_be_a_tag():
    splitter = ReasoningSplitter(in_thinking=True)
    assert splitter.feed("one <") == ("one ", "")
    assert splitter.feed("b") == ("<b", "")
    assert splitter.feed("</th") == ("", "")
    assert splitter.feed("ink>\n") == ("", "")
    assert splitter.feed("\nHi") == ("", "Hi")


def test_template_and_prompt_detection():
    assert template_thinks("{{ '<think>\\n' }} ... {{ '</think>' }}")
    assert template_thinks({"default": "<think></think>", "tool_use": "x"})
    assert not template_thinks("<|im_start|>assistant")
    assert not template_thinks(None)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
