"""The streamed answer on screen: markdown in a terminal, plain text through a pipe."""

from __future__ import annotations

import io
import re

from rich.console import Console

from baselm.chat.view import AnswerView


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
