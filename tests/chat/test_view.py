"""The streamed answer on screen: markdown in a terminal, plain text through a pipe."""

from __future__ import annotations

import io
import re

from rich.console import Console

from baselm.chat.answer import Answer
from baselm.chat.stats import turn_line
from baselm.chat.view import AnswerView
from baselm.reasoning import ReasoningSplitter
from baselm.request import RequestOutput


def test_a_finished_answer_is_rendered_as_markdown_in_a_terminal():
    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=60, height=20)
    with AnswerView(console, rich_output=True) as view:
        view.add("Two **points**:\n\n- first", 5)
        view.add("\n- second\n", 3)
    final = file.getvalue().rsplit("\x1b[2K", 1)[-1]  # what stays after the live view is erased
    final = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", final)
    assert "• first" in final and "• second" in final
    assert "**" not in final and "tokens · Ctrl-C stops" not in final


def test_an_answer_is_plain_text_when_stdout_is_not_a_terminal(capsys):
    with AnswerView(Console(file=io.StringIO()), rich_output=False) as view:
        view.add("Two **points**:\n\n- first", 5)
    assert capsys.readouterr().out == "Two **points**:\n\n- first\n"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)


def test_thinking_is_dimmed_above_the_answer_in_a_terminal():
    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=60, height=20)
    with AnswerView(console, rich_output=True, splitter=ReasoningSplitter(in_thinking=True)) as view:
        view.add("Weighing it.\n</th", 3)
        view.add("ink>\n\nThe **answer**.", 4)
    final = file.getvalue().rsplit("\x1b[2K", 1)[-1]
    assert "\x1b[2;3mWeighing it." in final  # dim italic
    text = _plain(final)
    assert text.index("Weighing it.") < text.index("The answer.")
    assert "<think>" not in text and "</think>" not in text and "**" not in text


def test_thinking_goes_to_stderr_when_stdout_is_not_a_terminal(capsys):
    with AnswerView(Console(file=io.StringIO()), rich_output=False, splitter=ReasoningSplitter()) as view:
        view.add("<think>hmm</think>\n\nYes", 3)
    out = capsys.readouterr()
    assert (out.out, out.err) == ("Yes\n", "hmm")


def test_without_a_splitter_think_tags_stay_in_the_answer(capsys):
    with AnswerView(Console(file=io.StringIO()), rich_output=False) as view:
        view.add("<think>hmm</think>Yes", 3)
    assert capsys.readouterr().out == "<think>hmm</think>Yes\n"


def test_the_line_after_an_answer_says_whether_max_tokens_or_the_runaway_guard_cut_it():
    answer = Answer()
    answer.add(RequestOutput("r", token_ids=[5, 6], finished=True, finish_reason="length", repeating=True), 0.1)
    assert answer.stats.repeating
    assert turn_line(answer.stats, 100).endswith("cut: it kept repeating itself (--runaway-guard 0 lets it run)")
    answer = Answer()
    answer.add(RequestOutput("r", token_ids=[5, 6], finished=True, finish_reason="length"), 0.1)
    assert turn_line(answer.stats, 100).endswith("cut at max_tokens")
