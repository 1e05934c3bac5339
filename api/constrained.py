"""SamplingParams whose answers follow a grammar, for the request field the grammar enforces.

The grammar is checked here (a StructuredOutputError naming the field, answered as a 400); the
params carry it as a `Constraint`, and each copy of the request gets its own processors, made by
`forcing.processor_factory` as any process that samples makes them.
"""

from __future__ import annotations

from typing import Any

import llguidance as llg

from baselm.api import serving
from baselm.api.state import ModelState
from baselm.sampling.params import Constraint, SamplingParams
from baselm.structured.grammar import check_endable, check_grammar, grammar_tokenizer
from baselm.toolcalls.forcing import processor_factory


def constrained_params(
    state: ModelState,
    sampling: dict[str, Any],
    max_tokens_field: str,
    text: str,
    param: str,
    *,
    lltokenizer: llg.LLTokenizer | None = None,
    tool_format: str | None = None,
    tool_close: str = "",
    **extra: Any,
) -> SamplingParams:
    """SamplingParams whose answer follows the grammar `text` (which enforces the request's `param`);
    each copy gets its own processors (`processor_factory`); `tool_format`: the answer forces tool
    calls written in that format, which `tool_close` closes as a whole (forced_formats.py)."""
    check_endable(sampling, param)
    if lltokenizer is None:
        lltokenizer = grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    check_grammar(text, lltokenizer, param)
    eos = state.eos_token_ids
    constraint = Constraint(text, list(eos), tool_format, tool_close)
    make = processor_factory(state.tokenizer, state.vocab_size)
    return serving.make_params(
        sampling,
        max_tokens_field,
        make_logits_processors=lambda: make(constraint),
        constraint=constraint,
        stop_token_ids=eos,
        **extra,
    )
