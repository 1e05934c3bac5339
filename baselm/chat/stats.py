"""A turn's numbers as the engine reported them, the session's totals, and the lines that show them."""

from __future__ import annotations

from dataclasses import dataclass, field

from baselm.scheduler import SchedulerStats


@dataclass(slots=True)
class TurnStats:
    """One answer's numbers, as the engine reported them (`base chat` per turn, `base run` once)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str | None = None
    repeating: bool = False  # cut by the runaway guard: the answer kept saying the same tokens
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return computed / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.num_output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(slots=True)
class SessionStats:
    """Every turn's numbers of one chat, for /stats."""

    turns: list[TurnStats] = field(default_factory=list)

    @property
    def last(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def total(self, name: str) -> float:
        return sum(getattr(t, name) for t in self.turns)

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(max(t.num_output_tokens - 1, 0) for t in self.turns)
        s = self.total("decode_s")
        return n / s if s > 0 else 0.0


def turn_line(stats: TurnStats, max_model_len: int) -> str:
    """The dimmed line after each answer: speeds and context use."""
    used = stats.num_prompt_tokens + stats.num_output_tokens
    parts = [
        f"prefill {stats.num_prompt_tokens} tokens ({stats.num_cached_tokens} cached) "
        f"{stats.prefill_tokens_per_s:.0f} tok/s",
        f"TTFT {stats.ttft_s * 1000:.0f} ms",
        f"decode {stats.num_output_tokens} tokens {stats.decode_tokens_per_s:.1f} tok/s",
        f"context {used}/{max_model_len}",
    ]
    if stats.num_draft_tokens:
        parts.append(f"speculative {stats.acceptance_rate:.0%} accepted")
    if stats.finish_reason == "abort":
        parts.append("stopped")
    elif stats.repeating:
        parts.append("cut: it kept repeating itself (--runaway-guard 0 lets it run)")
    elif stats.finish_reason == "length":
        parts.append("cut at max_tokens")
    return " · ".join(parts)


def stats_report(session: SessionStats, kv: SchedulerStats | None, max_model_len: int) -> str:
    """What /stats prints: the last turn, the session's totals and the KV cache's use."""
    lines = []
    last = session.last
    if last is None:
        lines.append("last turn: none yet")
    else:
        lines += [
            f"last turn: {last.num_prompt_tokens} prompt tokens, {last.num_cached_tokens} cached, "
            f"{last.num_output_tokens} generated ({last.finish_reason})",
            f"  TTFT {last.ttft_s * 1000:.0f} ms, prefill {last.prefill_tokens_per_s:.0f} tok/s, "
            f"decode {last.decode_tokens_per_s:.1f} tok/s, "
            f"context {last.num_prompt_tokens + last.num_output_tokens}/{max_model_len}",
        ]
    n = len(session.turns)
    mean_ttft = session.total("ttft_s") / n * 1000 if n else 0.0
    lines.append(
        f"session: {n} turn{'' if n == 1 else 's'}, {session.total('num_prompt_tokens'):.0f} prompt tokens "
        f"({session.total('num_cached_tokens'):.0f} cached), {session.total('num_output_tokens'):.0f} generated, "
        f"mean TTFT {mean_ttft:.0f} ms, decode {session.decode_tokens_per_s:.1f} tok/s"
    )
    if kv is not None:
        lines.append(
            f"KV cache: {kv.num_used_blocks}/{kv.num_used_blocks + kv.num_free_blocks} blocks in use "
            f"({kv.kv_usage:.1%}), prefix cache hit rate {kv.prefix_cache_hit_rate:.1%}"
        )
    return "\n".join(lines)
