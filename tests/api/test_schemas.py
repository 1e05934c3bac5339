"""The body readers' one check of a field that must be one of a few words (roles, pooling)."""

from __future__ import annotations

import pytest

from baselm.api.errors import APIError
from baselm.api.openai.chat import read_message
from baselm.api.schemas import check_choice


def test_a_choice_among_the_allowed_is_returned():
    assert check_choice("mean", ("mean", "last"), "pooling") == "mean"


def test_a_choice_outside_is_a_400_naming_the_field_and_the_choices():
    with pytest.raises(APIError) as caught:
        check_choice("max", ("mean", "last"), "pooling")
    assert (caught.value.status, caught.value.param) == (400, "pooling")
    assert caught.value.message == "pooling 'max' is not one of mean, last"


def test_a_message_role_outside_the_roles_names_its_message():
    with pytest.raises(APIError) as caught:
        read_message({"role": "robot", "content": "hi"}, 2)
    assert caught.value.param == "messages[2].role"
    assert "'robot' is not one of system, developer, user, assistant, tool" in caught.value.message
