"""gpt-oss's harmony answers: the analysis channel comes out as reasoning, the final channel as
content, a commentary call as a tool call; streamed in any split as whole."""

from __future__ import annotations

import random
from types import SimpleNamespace

from baselm.api.answer_text import AnswerText, thinking_splitter
from baselm.api.chat import sampling_params
from baselm.api.openai.chat import parse_chat
from baselm.harmony import HarmonySplitter
from baselm.toolcalls.markers import HARMONY
from tests.api.conftest import MODEL
from tests.api.test_tool_formats_served import WEATHER, tokenizer_with_special, with_defaults

THOUGHT = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(20, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _read(text: str, tools: list | None, seed: int | None = None) -> tuple[str, str, list]:
    """(reasoning, content, calls) of `text` read by the server's AnswerText, whole or in random pieces."""
    answer = AnswerText(HarmonySplitter(), HARMONY if tools else None, tools or ())
    pieces = [text] if seed is None else _pieces(text, seed)
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        got = answer.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content, calls = reasoning + got.reasoning, content + got.content, calls + got.calls
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def test_the_analysis_channel_is_reasoning_and_the_final_channel_the_answer():
    expected = ("The user wants the weather. Call the tool.", "It is sunny in Paris.", [])
    assert _read(THOUGHT + FINAL, None) == expected
    for seed in range(20):
        assert _read(THOUGHT + FINAL, None, seed) == expected
        assert _read(THOUGHT + FINAL, [WEATHER], seed) == expected


def test_a_commentary_call_after_the_reasoning_is_a_tool_call_only_when_tools_were_given():
    for seed in (None, *range(10)):
        assert _read(THOUGHT + CALL, [WEATHER], seed) == (
            "The user wants the weather. Call the tool.",
            "",
            [("get_weather", '{"city": "Paris"}')],
        )
    assert _read(THOUGHT + CALL, None)[2] == []


def test_an_answer_without_harmony_markers_is_content_as_it_is():
    assert _read("Just text, <b>with</b> brackets.", None) == ("", "Just text, <b>with</b> brackets.", [])
    splitter = HarmonySplitter()
    assert splitter.feed("<|chan") == ("", "")  # may still open a message: held
    assert splitter.feed("nel|>analysis<|message|>hm") == ("hm", "")
    assert splitter.finish() == ("", "")


def test_a_harmony_model_is_decoded_with_its_markers_and_split():
    tok = tokenizer_with_special("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
    state = SimpleNamespace(tool_format=HARMONY, tokenizer=tok, thinks=False)
    chat = with_defaults(parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}))
    assert sampling_params(state, chat).skip_special_tokens is False
    assert isinstance(thinking_splitter(state, [1, 2, 3]), HarmonySplitter)
