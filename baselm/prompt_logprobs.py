"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A request whose SamplingParams set `prompt_logprobs` (k alternatives; 0 for the token's own
only) gets, for every prompt token after the first, the log_softmax of the raw logits at the
position before it (no processors, bias or penalties: those shape answers, not prompts). This
is how evaluation harnesses score a text with a local model (`echo` with `logprobs`).

The scheduler needs no special case beyond one: such a request takes no prefix-cache hits
(`Request.computes_whole_prompt`), so every prompt position is fed through the model in some
step, chunked or not. Each step, the runner adds a logits row for every fed prompt position
whose next token is a prompt token (`rows`), and reads their logprobs back with the samples
(`PromptRows.collect`). A prompt recomputed after preemption reports its positions again;
the output processor keeps each position once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from baselm.sampling.params import TokenLogprobs
from baselm.sampling.sampler import SamplerOutput, _with_logprobs
from baselm.scheduler import ScheduledRequest


@dataclass(slots=True)
class PromptRows:
    """The extra logits rows of one step, one per scored prompt token, in the order they were added."""

    request_ids: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the scored token's place in the prompt (>= 1)
    target_ids: list[int] = field(default_factory=list)  # the scored token
    num_top: list[int] = field(default_factory=list)  # alternatives the request asked for
    flat_rows: list[int] = field(default_factory=list)  # the row of the token before it among the step's tokens
    scored: SamplerOutput | None = None  # the lazy logprobs, set by `score`

    def add(self, scheduled: ScheduledRequest, first_row: int) -> None:
        """Rows for `scheduled`'s fed tokens whose next token is a prompt token; `first_row` is where
        its tokens start among the step's flattened tokens."""
        request = scheduled.request
        num_top = getattr(request.sampling_params, "prompt_logprobs", None)
        if num_top is None:
            return
        prompt = request.prompt_token_ids
        start = scheduled.num_computed_tokens
        for position in range(start + 1, min(scheduled.context_len, len(prompt) - 1) + 1):
            self.request_ids.append(request.request_id)
            self.positions.append(position)
            self.target_ids.append(prompt[position])
            self.num_top.append(num_top)
            self.flat_rows.append(first_row + position - 1 - start)

    def score(self, logits: mx.array) -> None:
        """logits: (len(flat_rows), vocab), the rows' logits in order; starts their logprobs (lazily)."""
        if self.request_ids:
            targets = mx.array(self.target_ids, dtype=mx.int32)
            self.scored = _with_logprobs(logits.astype(mx.float32), targets, list(self.num_top))

    def arrays(self) -> list[mx.array]:
        """The lazy arrays to evaluate with the step."""
        if self.scored is None:
            return []
        parts = (self.scored.logprobs, self.scored.top_token_ids, self.scored.top_logprobs)
        return [a for a in parts if a is not None]

    def collect(self) -> dict[str, list[tuple[int, TokenLogprobs]]]:
        """Per request id: (position, logprobs of the prompt token there), in position order."""
        out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
        if self.scored is None:
            return out
        for request_id, position, entry in zip(self.request_ids, self.positions, self.scored.row_logprobs()):
            out.setdefault(request_id, []).append((position, entry))
        return out


def rows(requests: Sequence[ScheduledRequest]) -> PromptRows:
    """The prompt rows of a step's scheduled requests, in feed order."""
    prompt_rows = PromptRows()
    first_row = 0
    for scheduled in requests:
        prompt_rows.add(scheduled, first_row)
        first_row += scheduled.num_scheduled_tokens
    return prompt_rows
