"""GrammarProcessor driven by seeded random logits, without a server; the errors of a grammar
that cannot be enforced."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from baselm.structured.errors import StructuredOutputError
from baselm.structured.grammar import (
    GrammarProcessor,
    check_endable,
    check_grammar,
    grammar_tokenizer,
    json_schema_grammar,
)
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER
from tests.structured.schemas import PERSON, validate


def random_walk(processor, vocab: int, seed: int, eos: int, max_steps: int = 400) -> list[int]:
    """Greedy over seeded random logits, masked by `processor`, until eos."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(max_steps):
        logits = processor(out, mx.array(rng.normal(size=vocab).astype(np.float32)))
        token_id = int(mx.argmax(logits).item())
        if token_id == eos:
            return out
        out.append(token_id)
    raise AssertionError("the grammar did not finish")


def test_schema_grammar_works_when_the_model_has_fewer_rows_than_the_tokenizer():
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)  # 702 tokens; this model only emits ids < 256
    lltokenizer = grammar_tokenizer(tokenizer, 256, [2])
    grammar = json_schema_grammar(PERSON)
    for seed in range(5):
        ids = random_walk(GrammarProcessor(lltokenizer, grammar, [2]), 256, seed, eos=2)
        assert max(ids) < 256
        validate(json.loads(tokenizer.decode(ids)), PERSON)


def test_a_schema_llguidance_refuses_is_an_error_naming_the_field():
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": 7}}})
    with pytest.raises(StructuredOutputError, match="^response_format cannot be enforced: ") as caught:
        check_grammar(grammar, lltokenizer, "response_format")
    assert caught.value.param == "response_format"


@pytest.mark.parametrize("name", ["min_tokens", "ignore_eos"])
def test_min_tokens_and_ignore_eos_cannot_keep_a_grammar_from_ending_the_answer(name):
    sampling = {"min_tokens": 0, "ignore_eos": False}
    check_endable(sampling, "regex")
    with pytest.raises(StructuredOutputError, match=f"^{name} cannot be combined with regex ") as caught:
        check_endable({**sampling, name: 1 if name == "min_tokens" else True}, "regex")
    assert caught.value.param == name
