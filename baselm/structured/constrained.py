"""SamplingParams whose answers follow a grammar: each copy gets its own llguidance matcher.

The params carry the grammar as a `Constraint` (plain data) beside the processors made from it,
and `processor_factory` makes them in any process that has the model's tokenizer, so a prefill
or decode rank of another process makes the same processors from the same constraint.
"""

from __future__ import annotations

from typing import Any

import llguidance as llg

from baselm.api import serving
from baselm.loader import LoadedModel
from baselm.sampling.params import Constraint, ConstraintFactory, LogitsProcessor, SamplingParams
from baselm.structured import grammar
from baselm.structured.errors import StructuredOutputError
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls import tools


def check_endable(sampling: dict[str, Any], param: str) -> None:
    """A StructuredOutputError when min_tokens or ignore_eos would keep a finished grammar from ending the answer."""
    for name in ("min_tokens", "ignore_eos"):
        if sampling[name]:
            raise StructuredOutputError(
                f"{name} cannot be combined with {param} (the grammar decides where the answer ends)", name
            )


def processor_factory(tokenizer: Tokenizer, vocab_size: int) -> ConstraintFactory:
    """Makes a constraint's processors for a model with `tokenizer` and `vocab_size` output rows:
    a GrammarProcessor, or for forced tool calls one that also ends a repeating answer (RepeatStop)."""

    def make(constraint: Constraint) -> list[LogitsProcessor]:
        eos = list(constraint.eos_token_ids)
        lltokenizer = grammar.grammar_tokenizer(tokenizer, vocab_size, eos)
        if constraint.tool_format is not None:
            return [tools.RepeatStop(lltokenizer, constraint.grammar, eos, tokenizer, constraint.tool_format)]
        return [grammar.GrammarProcessor(lltokenizer, constraint.grammar, eos)]

    return make


def model_processor_factory(loaded: LoadedModel) -> ConstraintFactory:
    """`processor_factory` for a loaded model (a prefill or decode rank's)."""
    return processor_factory(loaded.tokenizer, loaded.model.args.vocab_size)


def constrained_params(
    state: serving.ServerState,
    sampling: dict[str, Any],
    max_tokens_field: str,
    text: str,
    param: str,
    *,
    lltokenizer: llg.LLTokenizer | None = None,
    tool_format: str | None = None,
    **extra: Any,
) -> SamplingParams:
    """SamplingParams whose answer follows the grammar `text` (which enforces the request's `param`);
    each copy gets its own processors (`processor_factory`); `tool_format`: the answer forces tool
    calls written in that format."""
    check_endable(sampling, param)
    if lltokenizer is None:
        lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    grammar.check_grammar(text, lltokenizer, param)
    eos = state.eos_token_ids
    constraint = Constraint(text, list(eos), tool_format)
    make = processor_factory(state.tokenizer, state.vocab_size)
    return serving.make_params(
        sampling,
        max_tokens_field,
        make_logits_processors=lambda: make(constraint),
        constraint=constraint,
        stop_token_ids=eos,
        **extra,
    )
