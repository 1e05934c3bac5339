"""/set: each setting read from text, and bad values refused with a message that says why."""

from __future__ import annotations

import pytest

from baselm.chat.settings import ChatCommandError, ChatSettings


def test_set_reads_each_setting():
    settings = ChatSettings()
    assert settings.with_value("temperature", "0.2").temperature == 0.2
    assert settings.with_value("top_p", "0.5").top_p == 0.5
    assert settings.with_value("top_k", "20").top_k == 20
    assert settings.with_value("min_p", "0.1").min_p == 0.1
    assert settings.with_value("repetition_penalty", "1.1").repetition_penalty == 1.1
    assert settings.with_value("max_tokens", "64").max_tokens == 64
    assert settings.with_value("max_tokens", "none").max_tokens is None
    assert settings.with_value("seed", "7").seed == 7
    assert settings.with_value("seed", "off").seed is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", "hot", "temperature takes a number, got 'hot'"),
        ("temperature", "-1", "temperature must lie in [0.0, 2.0], got -1.0."),
        ("top_p", "1.5", "top_p must lie in (0.0, 1.0], got 1.5."),
        ("max_tokens", "0", "max_tokens must be at least 1, got 0."),
        ("max_tokens", "2.5", "max_tokens takes a whole number (or none), got '2.5'"),
        ("top_k", "0.5", "top_k takes a whole number (or none), got '0.5'"),
        ("min_p", "2", "min_p must lie in [0.0, 1.0], got 2.0."),
        ("repetition_penalty", "0", "repetition_penalty must lie in (0.0, inf), got 0.0."),
        (
            "colour",
            "red",
            "/set knows temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed; got 'colour'",
        ),
    ],
)
def test_set_rejects_a_bad_value_with_a_message(name, value, message):
    with pytest.raises(ChatCommandError) as caught:
        ChatSettings().with_value(name, value)
    assert str(caught.value) == message


def test_a_chat_starts_from_the_generation_defaults():
    from baselm.sampling.defaults import GenerationDefaults, SamplingDefaults

    generation = GenerationDefaults(SamplingDefaults(top_k=5), SamplingDefaults(temperature=0.6), 1024)
    settings = ChatSettings.from_defaults(generation.resolved(), seed=3)
    assert settings == ChatSettings(
        temperature=0.6, top_p=0.95, top_k=5, min_p=0.05, repetition_penalty=1.0, max_tokens=512, seed=3
    )
    no_cap = GenerationDefaults(SamplingDefaults(max_tokens=0), SamplingDefaults(), 1024)
    assert ChatSettings.from_defaults(no_cap.resolved()).max_tokens is None  # the context's room
