"""Forcing tool calls by grammar (tool_choice required or a named tool), and the processors of
every constrained answer.

`forced_call_lark` is the grammar whose sentences are calls of the request's tools in the
model's format (`hermes` and `llama3_json` here, every other format the parser reads in
forced_formats.py), each call's arguments following its tool's JSON Schema. `RepeatStop` is its
processor: a GrammarProcessor that also ends the answer once a call repeats an earlier one.

A request's SamplingParams carry its grammar as a `Constraint` (plain data) beside the processors
made from it, and `processor_factory` makes them in any process that has the model's tokenizer,
so a prefill or decode rank of another process makes the same processors from the same
constraint. It lives here, above structured output, because a constraint may force tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np

from baselm.loader import LoadedModel
from baselm.sampling.params import Constraint, ConstraintFactory, LogitsProcessor
from baselm.structured import json_schemas
from baselm.structured.grammar import GrammarProcessor, grammar_tokenizer
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls import forced_formats
from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.parsers import HERMES, HERMES_CLOSE, HERMES_OPEN, LLAMA3_JSON, JsonCallParser, make_parser


def _calls_schema(tools: list[dict[str, Any]], fmt: str) -> dict[str, Any]:
    """One call of any of `tools`: an anyOf of {"name": const, "arguments": parameters}, each
    tool's definitions hoisted to the root (its refs would not resolve where it is nested)."""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters, tool_defs = json_schemas.nest(function["parameters"], f"/anyOf/{i}/properties/{key}", f"{i}.")
        defs.update(tool_defs)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": calls}
    if defs:
        schema["$defs"] = defs
    return json_schemas.prepare(schema)


def forced_call_lark(
    tools: list[dict[str, Any]],
    fmt: str,
    only: str | None,
    parallel: bool,
    marker_ids: Mapping[str, int] | None = None,
    template: str = "",
) -> str:
    """A Lark grammar (llguidance dialect) whose sentences are calls of `tools` in format `fmt`.

    `only` names the one tool allowed; `parallel` allows more than one call. `marker_ids`: the
    call markers the model's vocabulary holds as single tokens of their own (`marker_token_ids`);
    the grammar asks for those tokens, as the model writes them, instead of their text.
    `template`: the model's chat template, which tells a format's variants apart (forced_formats.py).
    """
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    if not chosen:
        raise ToolCallError(f"tool_choice names {only!r}, which is not among the tools", "tool_choice")
    if fmt in forced_formats.WRITERS:
        rules = "".join(f"args{i}: %json {json.dumps(_arguments_schema(t))}\n" for i, t in enumerate(chosen))
        return (
            forced_formats.format_lark(fmt, chosen, parallel, template, marker_ids or {}, lambda i: f"args{i}") + rules
        )
    schema = _calls_schema(chosen, fmt)

    def marker(text: str) -> str:
        return f"<[{marker_ids[text]}]>" if marker_ids and text in marker_ids else json.dumps(text)

    separator, open_, close = (
        ('";"', "", "")
        if fmt == LLAMA3_JSON
        else (r'"\n"', f'{marker(HERMES_OPEN)} "\\n" ', f' "\\n" {marker(HERMES_CLOSE)}')
    )
    repeat = f" ({separator} call)*" if parallel else ""
    return f"start: call{repeat}\ncall: {open_}body{close}\nbody: %json {json.dumps(schema)}\n"


def forced_close(fmt: str, template: str) -> str:
    """What closes a run of forced calls as a whole in `fmt` (`]`, `<｜tool▁calls▁end｜>`; "" for
    formats whose every call closes itself): `RepeatStop` writes it once a call repeats."""
    return forced_formats.WRITERS[fmt](template).after if fmt in forced_formats.WRITERS else ""


def _arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return json_schemas.prepare(tool["function"].get("parameters") or {"type": "object"})


def marker_token_ids(
    tokenizer: Tokenizer, lltokenizer: llg.LLTokenizer, markers: Sequence[str] = (HERMES_OPEN, HERMES_CLOSE)
) -> dict[str, int]:
    """The call `markers` that `tokenizer` spells as one token which llguidance holds as a special
    token (an added token, as Qwen2.5's `<tool_call>` is): the grammar must name that token, since
    its text spelled out in other tokens is not what the model writes, and llguidance matches no
    text against a special token's bytes."""
    ids = {}
    for text in markers:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and lltokenizer.is_special_token(encoded[0]):
            ids[text] = encoded[0]
    return ids


def forced_call_end(fmt: str) -> str:
    """What ends each forced call in `fmt` after its arguments, where a token may run past it
    (forced_formats.Writer.end; "" where no such token is to be feared)."""
    return forced_formats.WRITERS[fmt]("").end if fmt in forced_formats.WRITERS else ""


class RepeatStop(GrammarProcessor):
    """The forced-call grammar's processor that also ends the answer once a call closes that
    repeats an earlier one: the grammar would let a model that never stops call the same function
    until max_tokens. Where the format closes its calls as a whole (`close`: `]`,
    `<｜tool▁calls▁end｜>`, ...) the answer is complete only after that, so a repeat is seen in the
    answer with `close` added, and the close is then written, token by token, before the end.

    Where one token may run from a call's end into the next call (`end`, forced_call_end), a call
    that can end here as a repeat may go on with its arguments or end exactly, but no token takes
    it past its end: else the answer would be inside another call when the repeat shows."""

    def __init__(
        self,
        lltokenizer: llg.LLTokenizer,
        grammar: str,
        eos_token_ids: list[int],
        tokenizer: Tokenizer,
        fmt: str,
        close: str = "",
    ) -> None:
        super().__init__(lltokenizer, grammar, eos_token_ids)
        self.lltokenizer = lltokenizer
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.close = close
        self.end = forced_call_end(fmt)
        self.closing: tuple[int, list[int]] | None = None  # (where the close began, its token ids)

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        """logits: (vocab,) -> (vocab,), only end-of-sequence (or the close) left once a call repeated."""
        logits = super().__call__(output_ids, logits)
        if self.is_accepting and self.eos_token_ids and self._has_repeated(output_ids):
            return _only(logits, self.eos_token_ids)
        if self.closing is None and self.close and self._has_repeated(output_ids, self.close):
            self.closing = (len(output_ids), self.tokenizer.encode(self.close, add_special_tokens=False))
        if self.closing is not None and not self.is_accepting:
            start, ids = self.closing
            done = len(output_ids) - start
            if 0 <= done < len(ids) and output_ids[start:] == ids[:done] and np.isfinite(logits[ids[done]].item()):
                return _only(logits, [ids[done]])
            self.closing = None  # taken back (a preemption) or not where the grammar allows it: sample as it says
        if self.end and not self.is_accepting:
            rest = self._repeat_rest(output_ids)
            if rest:
                return self._not_past(logits, rest.encode("utf-8"))
        return logits

    def _repeat_rest(self, output_ids: list[int]) -> str:
        """What would end the answer here with the call being written as a repeat ("" when nothing would):
        the rest of `end` (the answer may stop inside it) and the close."""
        text = self.tokenizer.decode(output_ids)
        for size in range(len(self.end) - 1, -1, -1):
            if text.endswith(self.end[:size]) and self._has_repeated(output_ids, self.end[size:] + self.close):
                return self.end[size:] + self.close
        return ""

    def _not_past(self, logits: mx.array, rest: bytes) -> mx.array:
        """`logits` less the tokens that start on `rest` and leave it: each allowed token either goes on
        with the arguments (another first byte) or follows `rest`, ending within it."""
        allowed = np.flatnonzero(np.isfinite(np.array(logits)))
        cut = [
            int(i)
            for i in allowed
            if (b := self.lltokenizer.decode_bytes([int(i)]))[:1] == rest[:1] and not rest.startswith(b)
        ]
        if not cut:
            return logits
        keep = np.ones(logits.shape[0], dtype=bool)
        keep[cut] = False
        return mx.where(mx.array(keep), logits, -mx.inf)

    def _has_repeated(self, output_ids: list[int], close: str = "") -> bool:
        text = self.tokenizer.decode(output_ids) + close
        parser = JsonCallParser(self.fmt, forced=True) if self.fmt in (HERMES, LLAMA3_JSON) else make_parser(self.fmt)
        parser.feed(text)
        parser.finish()
        return parser.num_repeats > 0


def _only(logits: mx.array, ids: list[int]) -> mx.array:
    """`logits` with every id but `ids` at -inf."""
    keep = np.zeros(logits.shape[0], dtype=bool)
    keep[[i for i in ids if i < logits.shape[0]]] = True
    return mx.where(mx.array(keep), logits, -mx.inf)


def processor_factory(tokenizer: Tokenizer, vocab_size: int) -> ConstraintFactory:
    """Makes a constraint's processors for a model with `tokenizer` and `vocab_size` output rows:
    a GrammarProcessor, or for forced tool calls one that also ends a repeating answer (RepeatStop)."""

    def make(constraint: Constraint) -> list[LogitsProcessor]:
        eos = list(constraint.eos_token_ids)
        lltokenizer = grammar_tokenizer(tokenizer, vocab_size, eos)
        if constraint.tool_format is not None:
            fmt, close = constraint.tool_format, constraint.tool_close
            return [RepeatStop(lltokenizer, constraint.grammar, eos, tokenizer, fmt, close)]
        return [GrammarProcessor(lltokenizer, constraint.grammar, eos)]

    return make


def model_processor_factory(loaded: LoadedModel) -> ConstraintFactory:
    """`processor_factory` for a loaded model (a prefill or decode rank's)."""
    return processor_factory(loaded.tokenizer, loaded.model.args.vocab_size)
