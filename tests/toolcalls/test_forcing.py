"""Forcing calls by grammar: the forced-call grammars parse back to valid calls, each tool keeps
its own $defs, RepeatStop ends an answer once a call repeats, and every format of forced_formats.py
parses back to valid calls."""

from __future__ import annotations

import json

import llguidance as llg
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from baselm.structured.grammar import GrammarProcessor, grammar_tokenizer, lark_grammar
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls import forced_formats
from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.forcing import RepeatStop, forced_call_lark, forced_close, marker_token_ids
from baselm.toolcalls.markers import MARKERS
from baselm.toolcalls.parsers import HERMES, LLAMA3_JSON, make_parser
from tests.paths import BPE_TOKENIZER
from tests.structured.schemas import TIME, WEATHER, validate
from tests.structured.test_grammar import random_walk
from tests.structured.test_json_schemas import LLTOKENIZER, OTHER_TOOL, PYDANTIC_TOOL, accepts
from tests.toolcalls.test_json_calls import parse


def test_forced_calls_end_once_a_call_repeats():
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    lark = lark_grammar(forced_call_lark([WEATHER, TIME], HERMES, None, parallel=True))
    call = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>'
    vocab = tokenizer.vocab_size
    for text, only_eos in ((call, False), (call + "\n" + call, True)):
        processor = RepeatStop(lltokenizer, lark, [2], tokenizer, HERMES)
        ids = tokenizer.encode(text, add_special_tokens=False)
        allowed = np.isfinite(np.array(processor(ids, mx.zeros((vocab,)))))
        assert allowed[2]  # the calls may end here
        assert (allowed.sum() == 1) == only_eos  # and after a repeat they must


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_call_grammars_parse_back_to_valid_calls(fmt):
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    grammar = lark_grammar(forced_call_lark([WEATHER, TIME], fmt, None, parallel=True))
    for seed in range(4):
        text = tokenizer.decode(random_walk(GrammarProcessor(lltokenizer, grammar, [2]), tokenizer.vocab_size, seed, 2))
        content, calls = parse(fmt, [text])
        assert content == "" and calls, text
        for name, arguments in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[name]
            validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("only", [None, "add_person"])
def test_forced_calls_of_tools_with_defs_compile_and_keep_each_tools_own_defs(only):
    grammar = lark_grammar(forced_call_lark([PYDANTIC_TOOL, OTHER_TOOL], HERMES, only, parallel=False))
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, LLTOKENIZER)
    assert not is_error, messages
    call = '<tool_call>\n{"name":"add_person","arguments":{"name":"Ann","address":{"city":"Rome"}}}\n</tool_call>'
    assert accepts(grammar, call)
    assert not accepts(grammar, call.replace("Rome", "Oslo"))
    other = '<tool_call>\n{"name":"other","arguments":{"a":1}}\n</tool_call>'
    assert accepts(grammar, other) == (only is None)
    assert not accepts(grammar, other.replace(":1}", ":2}"))


def test_a_named_tool_that_is_not_among_the_tools_is_refused_naming_tool_choice():
    with pytest.raises(ToolCallError, match="tool_choice names 'nope', which is not among the tools") as caught:
        forced_call_lark([WEATHER], HERMES, "nope", parallel=False)
    assert caught.value.param == "tool_choice"


def walk_forced(
    fmt: str, template: str, tokenizer: Tokenizer, seed: int, parallel: bool = True, tools: tuple = (WEATHER, TIME)
) -> str:
    """A forced answer of seeded random logits, as the server samples it (RepeatStop, the close)."""
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    marker_ids = marker_token_ids(tokenizer, lltokenizer, MARKERS.get(fmt, ()))
    lark = forced_call_lark(list(tools), fmt, None, parallel, marker_ids, template)
    processor = RepeatStop(lltokenizer, lark_grammar(lark), [2], tokenizer, fmt, forced_close(fmt, template))
    # up to the 16 distinct calls of the two tools, each some 100 tokens in a marker-heavy format
    return tokenizer.decode(random_walk(processor, tokenizer.vocab_size, seed, 2, max_steps=3000))


@pytest.mark.parametrize("fmt", sorted(forced_formats.WRITERS))
@pytest.mark.parametrize("template", ["", "[ARGS] ```json"])  # the variants' tells: mistral v11, deepseek V3
def test_forced_calls_in_every_format_parse_back_to_valid_distinct_calls(fmt, template):
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    for seed in range(3):
        text = walk_forced(fmt, template, tokenizer, seed)
        parser = make_parser(fmt, True, [WEATHER, TIME])
        content, calls = parser.feed(text)
        more, more_calls = parser.finish()
        calls += more_calls
        assert content + more == "" and calls, text
        assert parser.num_repeats <= 1, text  # the answer ends at the first repeat (it is dropped)
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
            validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_markers_held_as_special_tokens_are_asked_for_as_those_tokens():
    backend = Backend.from_file(str(BPE_TOKENIZER / "tokenizer.json"))
    specials = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"]
    specials.append("<｜tool▁calls▁end｜>")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = json.loads((BPE_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_hf_files(backend.to_str(), config)
    ids = [tokenizer.token_to_id(t) for t in specials]
    lltokenizer = grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2])
    assert marker_token_ids(tokenizer, lltokenizer, MARKERS["deepseek"]) == dict(zip(specials, ids, strict=True))
    text = walk_forced("deepseek", "", tokenizer, seed=0)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert encoded[:2] == ids[:2]  # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>, each one token
    assert encoded[-1] == ids[-1] and make_parser("deepseek", True).feed(text)[0] == ""
