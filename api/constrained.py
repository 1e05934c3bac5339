"""SamplingParams whose answers follow a grammar: each copy gets its own llguidance matcher."""

from __future__ import annotations

from typing import Any

from baselm.api import grammar, serving
from baselm.api.errors import bad_request
from baselm.sampling import LogitsProcessor, SamplingParams


def constrained_params(
    state: serving.ServerState, sampling: dict[str, Any], max_tokens_field: str, text: str, param: str, **extra: Any
) -> SamplingParams:
    """SamplingParams whose answer follows the grammar `text` (which enforces the request's `param`)."""
    for name in ("min_tokens", "ignore_eos"):  # both would keep a finished grammar from ending the answer
        if sampling[name]:
            raise bad_request(
                f"{name} cannot be combined with {param} (the grammar decides where the answer ends)", name
            )
    lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    grammar.check_grammar(text, lltokenizer, param)
    eos = state.eos_token_ids

    def processors() -> list[LogitsProcessor]:
        return [grammar.GrammarProcessor(lltokenizer, text, eos)]

    return serving.make_params(
        sampling, max_tokens_field, make_logits_processors=processors, stop_token_ids=eos, **extra
    )
