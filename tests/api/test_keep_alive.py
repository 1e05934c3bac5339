"""Ollama's keep_alive values, read as Ollama reads them (api/keep_alive.py, baselm/duration.py)."""

from __future__ import annotations

import pytest

from baselm.api.errors import APIError
from baselm.api.keep_alive import parse_keep_alive
from baselm.duration import describe_duration


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("90s", 90.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("300", 300.0),
        (10, 10.0),
        (2.5, 2.5),
        (0, 0.0),
        ("0", 0.0),
        ("0s", 0.0),
    ],
)
def test_durations_and_numbers_are_seconds(value, seconds):
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [-1, "-1", "-5m", -0.5])
def test_a_negative_keep_alive_keeps_the_model_for_ever(value):
    assert parse_keep_alive(value) is None


@pytest.mark.parametrize("value", ["soon", "5 minutes", "5x", "", "m", True, [5], {"m": 5}])
def test_anything_else_is_a_400_naming_the_field(value):
    with pytest.raises(APIError) as caught:
        parse_keep_alive(value)
    assert caught.value.status == 400 and caught.value.param == "keep_alive"


def test_a_duration_is_described_in_its_largest_whole_unit():
    assert [describe_duration(s) for s in (None, 300.0, 7200.0, 90.0, 0.0)] == ["for ever", "5m", "2h", "90s", "0s"]
