"""Grammar-constrained decoding with llguidance: JSON objects, JSON Schemas, regexes and Lark
grammars (the forced-call grammar of baselm/toolcalls/forcing.py is one).

A `GrammarProcessor` is a logits processor (see baselm/sampling/params.py): each call it brings the
matcher to the tokens generated so far (forward, or back by llguidance's rollback when a
speculative step kept fewer than it verified), asks for the set of tokens the grammar
allows next, and sets every other logit to -inf. Each request gets its own processor, so
this works under batching. When the grammar is complete only end-of-sequence is allowed.

llguidance's tokenizer is built from our Tokenizer's vocabulary, cut to the model's own
vocabulary size: a model may have fewer output rows than its tokenizer has tokens, and the
grammar must never need a token the model cannot produce.

A grammar a request asks for that cannot be enforced raises `StructuredOutputError`, naming the
request field at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np

from baselm.structured import json_schemas
from baselm.structured.errors import StructuredOutputError
from baselm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("baselm.structured")

_LIMITS = llg.LLParserLimits(verbose_errors=False)


class _VocabEncoder:
    """What llguidance needs of a tokenizer: each id's bytes, and an encoder into those ids only."""

    def __init__(self, tokenizer: Tokenizer, token_bytes: list[bytes], special_ids: list[int], eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = token_bytes
        self.special_token_ids = special_ids
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_token_id if (tokenizer.bos_token_id or 0) < len(token_bytes) else None
        self._special = frozenset(special_ids)
        self._by_bytes = {b: i for i, b in enumerate(token_bytes) if b and i not in self._special}
        self._longest = max((len(b) for b in self._by_bytes), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        """`text` in ids whose bytes spell it. NOTE: never a special token's id, though the model's
        tokenizer matches added tokens in text (Qwen2.5's `<tool_call>`): llguidance gives a special
        token no bytes that text could match, so a grammar's text tokenized into one stalls it."""
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        try:
            ids = self.tokenizer.encode(raw.decode("utf-8"), add_special_tokens=False)
            if all(i < len(self.tokens) and i not in self._special for i in ids):
                return ids
        except UnicodeDecodeError:
            pass
        return self._greedy(raw)

    def _greedy(self, raw: bytes) -> list[int]:
        """Longest-match tokenization over the usable ids (for text the model's BPE would put out of range)."""
        ids, i = [], 0
        while i < len(raw):
            for size in range(min(self._longest, len(raw) - i), 0, -1):
                token_id = self._by_bytes.get(raw[i : i + size])
                if token_id is not None:
                    ids.append(token_id)
                    i += size
                    break
            else:
                i += 1  # a byte no token spells: skip it
        return ids


_CACHE: dict[tuple[int, int, tuple[int, ...]], llg.LLTokenizer] = {}


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's view of `tokenizer` over ids < vocab_size (built once per model, ~50 ms for 50k tokens)."""
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    if key not in _CACHE:
        full = llg.LLTokenizer(tokenizer.to_hf_files()[0], n_vocab=max(vocab_size, tokenizer.vocab_size))
        usable = min(vocab_size, tokenizer.vocab_size)
        token_bytes = [full.decode_bytes([i]) for i in range(usable)] + [b""] * (vocab_size - usable)
        special = [i for i in range(usable) if full.is_special_token(i)]
        eos = list(eos_token_ids) or [full.eos_token]
        encoder = _VocabEncoder(tokenizer, token_bytes, special, eos[0])
        _CACHE[key] = llg.LLTokenizer(llg.TokenizerWrapper(encoder), n_vocab=vocab_size, eos_token=eos)
    return _CACHE[key]


def json_schema_grammar(schema: dict[str, Any] | bool | None, param: str = "response_format") -> str:
    """The grammar of JSON text that follows `schema` (None: any JSON object), made to end (json_schemas.py)."""
    if schema is None:
        schema = {"type": "object"}
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(json_schemas.prepare(schema)))
    except (ValueError, RecursionError) as exc:
        raise StructuredOutputError(f"{param}: the schema is not valid: {exc}", param) from None


def regex_grammar(regex: str) -> str:
    """The grammar of text matching `regex` whole (checked by `check_grammar`)."""
    return llg.LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str) -> str:
    return llg.LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str, lltokenizer: llg.LLTokenizer, param: str, what: str = "") -> None:
    """Raises StructuredOutputError naming `param` when llguidance refuses the grammar (a bad or
    unsupported schema); `what` says what the grammar came from (default: `param` cannot be enforced)."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer, limits=_LIMITS)
    if is_error:
        raise StructuredOutputError(f"{what or param + ' cannot be enforced'}: {messages[0]}", param)


def check_endable(sampling: dict[str, Any], param: str) -> None:
    """Raises StructuredOutputError when min_tokens or ignore_eos (of SamplingParams' fields in
    `sampling`) would keep a finished grammar, which enforces the request's `param`, from ending the answer."""
    for name in ("min_tokens", "ignore_eos"):
        if sampling[name]:
            raise StructuredOutputError(
                f"{name} cannot be combined with {param} (the grammar decides where the answer ends)", name
            )


class GrammarProcessor:
    """Masks each step's logits to the tokens a grammar allows; one per request copy."""

    def __init__(self, lltokenizer: llg.LLTokenizer, grammar: str, eos_token_ids: Sequence[int]) -> None:
        self.matcher = llg.LLMatcher(lltokenizer, grammar, log_level=0, limits=_LIMITS)
        self.eos_token_ids = list(eos_token_ids)
        self.consumed: list[int] = []  # the tokens the matcher holds, in order
        self.is_past_refused = False  # the last ids asked for hold a token the grammar refuses

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        """logits: (vocab,) -> (vocab,) with disallowed tokens at -inf."""
        self._advance(output_ids)
        vocab = logits.shape[0]
        allowed = self._allowed(vocab)  # (vocab,) bool
        if not allowed.any() and self.eos_token_ids:
            allowed[[i for i in self.eos_token_ids if i < vocab]] = True
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def num_allowed(self, output_ids: list[int], draft_ids: list[int]) -> int:
        """How many of `draft_ids`, after `output_ids`, the grammar allows in a row (speculative
        proposals are cut there)."""
        self._advance(output_ids)
        if self.is_past_refused or self.matcher.is_error():
            return 0
        return self.matcher.validate_tokens(list(draft_ids))

    def _advance(self, output_ids: list[int]) -> None:
        """Brings the matcher to `output_ids`: back to what they share with the tokens it holds,
        then forward. Rows that verify speculative tokens walk it forward through the drafts,
        and the next call takes it back to the tokens that were kept (or to fewer, after a
        preemption).

        NOTE: a token the grammar refuses is never consumed (llguidance's matcher would stay in
        error for good, rollback or not); the matcher stops before it and `is_past_refused` is
        set. Drafts past an end (a draft model's) get there; decoding one token at a time does
        not, as its tokens come from the mask."""
        held = len(self.consumed)
        if output_ids[:held] != self.consumed:
            same = 0
            while same < min(held, len(output_ids)) and self.consumed[same] == output_ids[same]:
                same += 1
            self.matcher.rollback(held - same)
            del self.consumed[same:]
        new_ids = list(output_ids[len(self.consumed) :])
        num_valid = self.matcher.validate_tokens(new_ids) if new_ids and not self.matcher.is_error() else 0
        if num_valid:
            self.matcher.consume_tokens(new_ids[:num_valid])
            self.consumed += new_ids[:num_valid]
        self.is_past_refused = num_valid < len(new_ids)
        if self.is_past_refused:
            logger.debug("grammar refused token %d after %d tokens", new_ids[num_valid], len(self.consumed))

    def _allowed(self, vocab: int) -> np.ndarray:
        if self.is_past_refused or self.matcher.is_error():
            return np.zeros(vocab, dtype=bool)
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)  # (32 * num_words,)
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.shape[0])
        allowed[:n] = bits[:n]
        return allowed
