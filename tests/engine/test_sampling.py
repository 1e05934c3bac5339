"""SamplingParams: every range refused with an error naming the field, normalization, copies."""

from __future__ import annotations

import pytest

from baselm.sampling.params import MAX_SEED, SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"n": 17}, "n"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_each_bad_field_raises_an_error_naming_it(bad, name):
    with pytest.raises(SamplingParamsError, match=name) as info:
        SamplingParams(**bad)
    assert info.value.field == name
    assert str(info.value).endswith(".") and "\n" not in str(info.value)


def test_defaults_and_normalization():
    p = SamplingParams(stop="###", max_tokens=None, top_k=-1, logprobs=20, seed=-5)
    assert p.stop == ["###"] and p.max_tokens is None and p.n == 1 and not p.greedy
    assert SamplingParams().max_tokens == 256


def test_a_copy_draws_with_seed_plus_its_index_and_makes_its_own_processors():
    made = []

    def make():
        made.append([lambda output_ids, logits: logits])
        return made[-1]

    params = SamplingParams(n=3, seed=10, make_logits_processors=make)
    copies = [params.for_copy(i) for i in range(3)]
    assert [c.seed for c in copies] == [10, 11, 12]
    assert [c.logits_processors for c in copies] == made and len(made) == 3
    assert SamplingParams(n=2, seed=MAX_SEED).for_copy(1).seed == 0  # mod 2**64, as the sampler's keys
    assert SamplingParams(n=2).for_copy(1).seed is None


def test_check_vocab_rejects_token_ids_outside_the_vocabulary():
    SamplingParams(logit_bias={7: 1.0}, stop_token_ids=[7]).check_vocab(8)
    with pytest.raises(SamplingParamsError, match="logit_bias") as info:
        SamplingParams(logit_bias={8: 1.0}).check_vocab(8)
    assert info.value.field == "logit_bias"
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[9]).check_vocab(8)


@pytest.mark.parametrize(
    ("params", "reads_back"),
    [
        (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), False),  # llama.cpp's defaults
        (SamplingParams(temperature=1.0, top_p=1.0), False),  # no cut at all
        (SamplingParams(temperature=0.0, top_p=0.5), False),  # greedy
        (SamplingParams(temperature=1.0, top_p=0.95), True),  # a nucleus that may pass the sorted candidates
        (SamplingParams(temperature=1.0, top_k=1000), True),  # more than the candidates
        (SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1), True),  # penalties read the ids
    ],
)
def test_which_draws_need_the_host_before_the_next_step_can_launch(params, reads_back):
    assert params.needs_host_ids(vocab_size=49152) is reads_back
