"""/set: each setting read from text, and bad values refused with a message that says why."""

from __future__ import annotations

import pytest

from baselm.chat.settings import ChatCommandError, ChatSettings


def test_set_reads_each_setting():
    settings = ChatSettings()
    assert settings.with_value("temperature", "0.2").temperature == 0.2
    assert settings.with_value("top_p", "0.5").top_p == 0.5
    assert settings.with_value("max_tokens", "64").max_tokens == 64
    assert settings.with_value("max_tokens", "none").max_tokens is None
    assert settings.with_value("seed", "7").seed == 7
    assert settings.with_value("seed", "off").seed is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", "hot", "temperature takes a number, got 'hot'"),
        ("temperature", "-1", "temperature must lie in [0.0, inf), got -1.0."),
        ("top_p", "1.5", "top_p must lie in (0.0, 1.0], got 1.5."),
        ("max_tokens", "0", "max_tokens must be at least 1, got 0."),
        ("max_tokens", "2.5", "max_tokens takes a whole number (or none), got '2.5'"),
        ("colour", "red", "/set knows temperature, top_p, max_tokens, seed; got 'colour'"),
    ],
)
def test_set_rejects_a_bad_value_with_a_message(name, value, message):
    with pytest.raises(ChatCommandError) as caught:
        ChatSettings().with_value(name, value)
    assert str(caught.value) == message
