"""An answer as it arrives from the engine: its text, token ids, log-probabilities and numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from baselm.chat.stats import TurnStats
from baselm.request import RequestOutput
from baselm.sampling.params import TokenLogprobs


@dataclass(slots=True)
class Answer:
    """One request's outputs gathered as they stream in (`base chat` keeps it outside the coroutine that
    streams, so a stopped turn keeps what came; `base run` prints it)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stats: TurnStats = field(default_factory=TurnStats)

    def add(self, out: RequestOutput, elapsed_s: float) -> None:
        """Takes one output that arrived `elapsed_s` seconds after the request was sent."""
        if out.token_ids and not self.token_ids:
            self.stats.ttft_s = elapsed_s
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.stats.num_output_tokens = len(self.token_ids)
        self.stats.num_cached_tokens = out.num_cached_tokens
        self.stats.finish_reason, self.stats.repeating = out.finish_reason, out.repeating
        self.stats.num_draft_tokens, self.stats.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
