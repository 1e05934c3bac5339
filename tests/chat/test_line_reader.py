"""Multi-line messages: a trailing backslash, or a block between triple quotes."""

from __future__ import annotations

from baselm.chat.line_reader import join_continued


def test_a_trailing_backslash_continues_the_line():
    more = iter(["second \\", "third"])
    assert join_continued("first \\", lambda: next(more)) == "first \nsecond \nthird"


def test_triple_quotes_enclose_a_block():
    more = iter(["line one", "", "line two", '"""'])
    assert join_continued('"""', lambda: next(more)) == "line one\n\nline two"
    assert join_continued('"""one line"""', lambda: "") == "one line"
