"""StopChecker: stop ids, eos, max_tokens, and stop strings with held-back streaming text."""

from __future__ import annotations

import pytest

from baselm.sampling.params import SamplingParams
from baselm.sampling.stop import StopChecker, StopUpdate

EOS = 0
WORD = 7  # an ordinary token id


def feed(checker: StopChecker, deltas: list[str], token_ids: list[int] | None = None) -> list[StopUpdate]:
    """Feeds text deltas (with ordinary token ids unless given) until the checker finishes."""
    token_ids = token_ids or [WORD] * len(deltas)
    updates = []
    for token_id, delta in zip(token_ids, deltas):
        updates.append(checker.update(token_id, delta))
        if checker.is_finished:
            break
    return updates


def streamed(updates: list[StopUpdate]) -> str:
    return "".join(u.text for u in updates)


def checker(**params) -> StopChecker:
    params.setdefault("max_tokens", 100)
    return StopChecker(SamplingParams(**params), eos_token_ids=[EOS])


# --- stop strings ------------------------------------------------------------------------


def test_a_stop_string_split_across_deltas_is_held_back_and_cut():
    c = checker(stop=["lo w"])
    first = c.update(WORD, "Hel")
    assert first == StopUpdate("He")  # "l" may begin "lo w"
    assert c.held_text == "l"
    second = c.update(WORD, "lo wor")
    assert second == StopUpdate("l", "stop", "lo w")
    assert c.is_finished and c.held_text == ""
    with pytest.raises(RuntimeError, match="already finished"):
        c.update(WORD, "ld")


def test_include_stop_str_in_output_keeps_the_stop_string_and_drops_what_follows():
    updates = feed(checker(stop=["lo w"], include_stop_str_in_output=True), ["Hel", "lo wor", "ld"])
    assert streamed(updates) == "Hello w"
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", "lo w")


def test_held_back_text_is_released_when_the_partial_match_fails():
    c = checker(stop=["lo w"])
    assert c.update(WORD, "Hel") == StopUpdate("He")
    assert c.update(WORD, "lo") == StopUpdate("l")  # "lo" still may begin "lo w"
    assert c.update(WORD, "!") == StopUpdate("lo!")
    assert c.held_text == "" and not c.is_finished


def test_the_stop_string_completed_first_wins():
    updates = feed(checker(stop=["world", "o w"]), ["Hello world"])
    assert updates == [StopUpdate("Hell", "stop", "o w")]
    # "bc" completes before "abcd", though "abcd" starts earlier.
    assert feed(checker(stop=["abcd", "bc"]), ["xabcd"]) == [StopUpdate("xa", "stop", "bc")]
    # On the same end, the longer (earlier) match wins.
    assert feed(checker(stop=["ld", "world"]), ["Hello world"]) == [StopUpdate("Hello ", "stop", "world")]


@pytest.mark.parametrize(
    "deltas",
    [["Hello world, bye"], list("Hello world, bye"), ["He", "llo w", "or", "ld, b", "ye"], ["Hello wo", "rld, bye"]],
)
def test_the_result_does_not_depend_on_how_the_text_is_split(deltas):
    updates = feed(checker(stop=["world", "o w", "xyz"]), deltas)
    assert streamed(updates) == "Hell"
    assert updates[-1].stop_reason == "o w"


def test_a_stop_string_at_the_very_start_gives_empty_output():
    assert feed(checker(stop=["STOP"]), ["STOP now"]) == [StopUpdate("", "stop", "STOP")]
    updates = feed(checker(stop=["STOP"]), ["ST", "OP", "more"])
    assert [u.text for u in updates] == ["", ""] and updates[-1].finish_reason == "stop"


def test_text_without_any_stop_prefix_streams_at_once():
    c = checker(stop=["###"])
    assert c.update(WORD, "plain text") == StopUpdate("plain text")
    assert c.update(WORD, " ends #") == StopUpdate(" ends ")


# --- token ids, eos, length -----------------------------------------------------------


def test_eos_stops_and_its_text_is_dropped_while_held_text_is_released():
    c = checker(stop=["lo w"])
    assert c.update(WORD, "Hel") == StopUpdate("He")
    assert c.update(EOS, "</s>") == StopUpdate("l", "stop", None)


def test_stop_token_ids_stop_with_the_id_as_reason():
    assert feed(checker(stop_token_ids=[5]), ["a", "b", "<end>"], [WORD, WORD, 5])[-1] == StopUpdate("", "stop", 5)
    kept = feed(checker(stop_token_ids=[5], include_stop_str_in_output=True), ["a", "<end>"], [WORD, 5])
    assert kept[-1] == StopUpdate("<end>", "stop", 5)


def test_ignore_eos_treats_eos_as_an_ordinary_token():
    updates = feed(checker(ignore_eos=True, max_tokens=3), ["a", "<eos>", "b"], [WORD, EOS, WORD])
    assert streamed(updates) == "a<eos>b"
    assert updates[-1].finish_reason == "length" and updates[-1].stop_reason is None


def test_max_tokens_finishes_with_length_and_flushes_held_text():
    updates = feed(checker(max_tokens=2, stop=["lo w"]), ["Hel", "lo"])
    assert updates == [StopUpdate("He"), StopUpdate("llo", "length", None)]


def test_a_stop_on_the_last_allowed_token_reports_stop_not_length():
    assert feed(checker(max_tokens=2), ["a", "</s>"], [WORD, EOS])[-1].finish_reason == "stop"
    assert feed(checker(max_tokens=2, stop=["b"]), ["a", "b"])[-1] == StopUpdate("", "stop", "b")


def test_the_engine_cap_limits_max_tokens_further():
    c = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=[EOS], max_tokens=3)
    assert c.max_tokens == 3
    assert feed(c, ["a", "b", "c", "d"])[-1] == StopUpdate("c", "length", None)
    unlimited = StopChecker(SamplingParams(max_tokens=None), eos_token_ids=[EOS])
    assert unlimited.max_tokens is None
    assert not any(u.finish_reason for u in feed(unlimited, ["x"] * 500))


# --- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_suppresses_eos_stop_ids_and_stop_strings_until_reached():
    c = checker(min_tokens=3, stop=["!"], stop_token_ids=[5])
    assert c.update(EOS, "<eos>") == StopUpdate("<eos>")
    assert c.update(5, "!") == StopUpdate("!")
    assert c.update(WORD, "x!") == StopUpdate("x!")
    assert c.update(WORD, "ok!") == StopUpdate("ok", "stop", "!")  # the 4th token is the first that may stop


def test_min_tokens_lets_the_first_token_after_it_stop_on_eos():
    updates = feed(checker(min_tokens=2), ["a", "b", "</s>"], [EOS, WORD, EOS])
    assert streamed(updates) == "ab" and updates[-1] == StopUpdate("", "stop", None)
    assert len(updates) == 3


def test_flush_hands_back_the_held_text_once():
    c = checker(stop=["abc"])
    assert c.update(WORD, "xab") == StopUpdate("x")
    assert c.flush() == "ab" and c.flush() == ""
