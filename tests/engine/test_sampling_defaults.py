"""The generation defaults: which value a request gets for what it leaves out (baselm/sampling/defaults.py)."""

from __future__ import annotations

import logging

import pytest

from baselm.sampling.defaults import (
    LLAMA_CPP,
    NO_DEFAULTS,
    GenerationDefaults,
    SamplingDefaults,
    default_max_tokens,
    model_defaults,
)
from baselm.sampling.params import SamplingParams, SamplingParamsError

OLLAMA_LIKE = SamplingDefaults(temperature=0.8, top_p=0.9, top_k=40, min_p=0.0, repetition_penalty=1.1)


def test_without_any_source_a_request_gets_llama_cpps_set_and_the_cap():
    generation = GenerationDefaults(NO_DEFAULTS, NO_DEFAULTS, 8192)
    assert generation.fill({"seed": 3}) == {
        "seed": 3,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.0,
        "max_tokens": 2048,
    }
    SamplingParams(**generation.fill({}))  # what a request gets is a valid request


def test_the_cap_is_2048_tokens_or_half_the_context():
    assert [default_max_tokens(n) for n in (8192, 4096, 2048, 512, 3)] == [2048, 2048, 1024, 256, 1]


def test_a_value_the_request_sends_wins_over_every_default():
    generation = GenerationDefaults(SamplingDefaults(temperature=0.1), SamplingDefaults(temperature=0.6), 8192)
    filled = generation.fill({"temperature": 1.5, "top_k": 0, "max_tokens": 7}, OLLAMA_LIKE)
    assert (filled["temperature"], filled["top_k"], filled["max_tokens"]) == (1.5, 0, 7)


def test_command_line_then_model_then_api_then_llama_cpp():
    given = SamplingDefaults(temperature=0.1)
    model = SamplingDefaults(temperature=0.6, top_p=0.8)
    api = SamplingDefaults(temperature=0.9, top_p=0.7, top_k=20, max_tokens=16)
    resolved = GenerationDefaults(given, model, 8192).resolved(api)
    assert resolved == SamplingDefaults(
        temperature=0.1, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.0, max_tokens=16
    )


def test_an_apis_own_defaults_apply_only_where_the_model_has_none():
    generation = GenerationDefaults(NO_DEFAULTS, SamplingDefaults(temperature=0.7, top_k=20), 8192)
    filled = generation.fill({}, OLLAMA_LIKE)
    assert filled == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.1,
        "max_tokens": 2048,
    }


def test_max_tokens_0_on_the_command_line_lifts_the_cap_but_a_request_may_still_ask_for_0():
    generation = GenerationDefaults(SamplingDefaults(max_tokens=0), NO_DEFAULTS, 8192)
    assert generation.fill({})["max_tokens"] is None  # up to the context's room
    assert generation.max_tokens is None
    assert generation.fill({"max_tokens": 0})["max_tokens"] == 0  # completions' echo-only scoring asks for 0


def test_a_bad_default_is_refused_naming_it():
    with pytest.raises(SamplingParamsError, match="temperature") as caught:
        SamplingDefaults(temperature=3.0)
    assert caught.value.field == "temperature"
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingDefaults(max_tokens=-1)


def test_the_models_defaults_are_its_generation_config_in_hfs_names():
    config = {"generation_config": {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}}
    assert model_defaults(config) == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    assert model_defaults({}) == NO_DEFAULTS
    assert model_defaults({"generation_config": {"max_new_tokens": 32768}}) == NO_DEFAULTS  # the cap is the server's


def test_an_explicit_do_sample_false_is_greedy_as_in_transformers():
    assert model_defaults({"generation_config": {"do_sample": False, "temperature": 0.6}}).temperature == 0.0
    assert model_defaults({"generation_config": {"temperature": 0.6}}).temperature == 0.6


def test_a_model_value_out_of_range_is_left_out_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="baselm.sampling"):
        defaults = model_defaults({"generation_config": {"temperature": 5.0, "top_p": 0.9}})
    assert defaults == SamplingDefaults(top_p=0.9)
    assert "generation_config sets temperature" in caplog.text


def test_describe_says_the_values_their_sources_and_the_cap():
    assert GenerationDefaults(NO_DEFAULTS, NO_DEFAULTS, 8192).describe() == (
        "temperature 0.8, top_p 0.95, top_k 40, min_p 0.05, repetition_penalty 1 (from llama.cpp) "
        "and at most 2048 tokens"
    )
    mixed = GenerationDefaults(SamplingDefaults(max_tokens=0), SamplingDefaults(temperature=0.6), 8192)
    assert mixed.describe() == (
        "temperature 0.6, top_p 0.95, top_k 40, min_p 0.05, repetition_penalty 1 "
        "(from the command line, then the model, then llama.cpp) and no token cap"
    )
    full = SamplingDefaults(**{**LLAMA_CPP.as_dict(), "temperature": 0.2})
    assert (
        GenerationDefaults(full, NO_DEFAULTS, 8192)
        .describe()
        .endswith("(from the command line) and at most 2048 tokens")
    )
