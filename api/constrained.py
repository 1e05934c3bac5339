"""SamplingParams whose answers follow a grammar: each copy gets its own llguidance matcher."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import llguidance as llg

from baselm.api import grammar, serving
from baselm.api.errors import bad_request
from baselm.sampling import LogitsProcessor, SamplingParams

MakeProcessor = Callable[[llg.LLTokenizer, str, Sequence[int]], LogitsProcessor]


def check_endable(sampling: dict[str, Any], param: str) -> None:
    """A 400 when min_tokens or ignore_eos would keep a finished grammar from ending the answer."""
    for name in ("min_tokens", "ignore_eos"):
        if sampling[name]:
            raise bad_request(
                f"{name} cannot be combined with {param} (the grammar decides where the answer ends)", name
            )


def constrained_params(
    state: serving.ServerState,
    sampling: dict[str, Any],
    max_tokens_field: str,
    text: str,
    param: str,
    *,
    lltokenizer: llg.LLTokenizer | None = None,
    make_processor: MakeProcessor = grammar.GrammarProcessor,
    **extra: Any,
) -> SamplingParams:
    """SamplingParams whose answer follows the grammar `text` (which enforces the request's `param`);
    each copy gets its own `make_processor(lltokenizer, text, eos ids)`."""
    check_endable(sampling, param)
    if lltokenizer is None:
        lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    grammar.check_grammar(text, lltokenizer, param)
    eos = state.eos_token_ids

    def processors() -> list[LogitsProcessor]:
        return [make_processor(lltokenizer, text, eos)]

    return serving.make_params(
        sampling, max_tokens_field, make_logits_processors=processors, stop_token_ids=eos, **extra
    )
