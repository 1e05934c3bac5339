"""`base perplexity`: how well a model predicts a plain text, through the real paged model path.

Definition. The text is tokenized as plain text (no chat template; a BOS token only when the
tokenizer's config adds one), giving tokens x_0 .. x_{N-1}. Every token but the first is a
target, scored exactly once as

    nll_t = -log softmax(logits(x_start .. x_{t-1}))[x_t]          for t = 1 .. N-1

where `start` is the first token of the window that scores t. Windows hold at most `context`
tokens and start every `stride` tokens (window w feeds x_{w*stride} .. x_{min(w*stride+context,
N)-1}); a window scores only the targets no earlier window scored, so after the first window
each target sees at least `context - stride` tokens before it. Then

    mean_nll = sum(nll_t) / (N - 1)        perplexity = exp(mean_nll)

Each window is one forward step of one sequence through a PagedKVCache, with logits (upcast to
float32) at the rows of its targets; the KV pools take the model's dtype, or 8/4-bit affine
codes with `kv_bits`. `tokens_per_second` counts the tokens fed to the model, overlaps included.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from baselm.kv import AttentionMetadata, PagedKVCache
from baselm.models.base import DecoderModel
from baselm.tokenizer.tokenizer import Tokenizer

DEFAULT_CONTEXT = 512
KV_BITS = (16, 8, 4)
BLOCK_SIZE = 16


class PerplexityError(ValueError):
    """The text, context or stride cannot give a perplexity."""


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """One forward step: tokens `start:end` go in, targets `first_target:end` are scored."""

    start: int
    end: int
    first_target: int


@dataclasses.dataclass(frozen=True, slots=True)
class PerplexityResult:
    """A perplexity and how it was measured (the JSON of `base perplexity --json`)."""

    perplexity: float
    mean_nll: float
    num_scored: int  # targets: every token but the first, once each
    num_evaluated: int  # tokens fed to the model, window overlaps counted again
    num_windows: int
    context: int
    stride: int
    kv_bits: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.num_evaluated / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, float | int]:
        return {**dataclasses.asdict(self), "tokens_per_second": self.tokens_per_second}


def default_stride(context: int) -> int:
    """Half a window: every target after the first window sees at least context/2 tokens."""
    return max(1, context // 2)


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows that score targets 1 .. num_tokens-1 exactly once, in order.

    NOTE: stride < context, so consecutive windows overlap by at least one token and the first
    token a window scores always has a token before it in the same window.
    """
    check_window(context, stride)
    if num_tokens < 2:
        raise PerplexityError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, start, scored_end = [], 0, 1
    while True:
        end = min(start + context, num_tokens)
        windows.append(Window(start, end, scored_end))
        if end == num_tokens:
            return windows
        start, scored_end = start + stride, end


def check_window(context: int, stride: int, max_context: int | None = None) -> None:
    """Raises PerplexityError unless 2 <= context (<= max_context) and 1 <= stride < context."""
    if context < 2:
        raise PerplexityError(f"context must be at least 2 tokens, got {context}")
    if max_context is not None and context > max_context:
        raise PerplexityError(
            f"context {context} is longer than the model's {max_context} positions; "
            f"pass --context {max_context} or less"
        )
    if not 1 <= stride < context:
        raise PerplexityError(f"stride must be at least 1 and less than the context ({context}), got {stride}")


def check_kv_bits(kv_bits: int) -> None:
    """Raises PerplexityError unless the KV pools can hold `kv_bits` (16: the model dtype)."""
    if kv_bits not in KV_BITS:
        raise PerplexityError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {kv_bits}")


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Plain-text token ids: BOS (or EOS) only where the tokenizer's config adds them."""
    return tokenizer.encode(text, add_special_tokens=True)


def make_cache(model: DecoderModel, context: int, kv_bits: int = 16) -> PagedKVCache:
    """A cache holding one window of `context` tokens, pools in the model dtype or `kv_bits` codes."""
    check_kv_bits(kv_bits)
    num_blocks = -(-context // BLOCK_SIZE)
    return PagedKVCache.for_model(model, num_blocks, BLOCK_SIZE, kv_bits=kv_bits)


def window_nlls(model: DecoderModel, cache: PagedKVCache, token_ids: list[int], window: Window) -> np.ndarray:
    """The negative log-likelihoods (float64) of the window's targets, in order.

    The window is a fresh sequence in blocks 0.. of `cache`: earlier windows' slots are
    overwritten and the context length hides the rest.
    """
    length = window.end - window.start
    table = list(range(-(-length // cache.block_size)))
    rows = list(range(window.first_target - window.start - 1, length - 1))  # row i predicts token start+i+1
    meta = AttentionMetadata.build([table], [length], [length], cache.block_size, logits_indices=rows)
    inputs = mx.array(token_ids[window.start : window.end], dtype=mx.int32)  # (length,)
    logits = model(inputs, meta.positions, meta, cache).astype(mx.float32)  # (num_targets, vocab)
    targets = mx.array(token_ids[window.first_target : window.end], dtype=mx.int32)  # (num_targets,)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    nll = mx.logsumexp(logits, axis=-1) - picked  # (num_targets,)
    return np.array(nll, dtype=np.float64)


def token_nlls(
    model: DecoderModel, token_ids: list[int], context: int, stride: int, kv_bits: int = 16
) -> tuple[np.ndarray, list[Window]]:
    """NLL of every target 1 .. N-1 (float64, (N-1,)) and the windows that scored them."""
    windows = plan_windows(len(token_ids), context, stride)
    cache = make_cache(model, min(context, len(token_ids)), kv_bits)
    nlls = np.concatenate([window_nlls(model, cache, token_ids, w) for w in windows])  # (N-1,)
    return nlls, windows


def perplexity(
    model: DecoderModel,
    token_ids: list[int],
    context: int = DEFAULT_CONTEXT,
    stride: int | None = None,
    kv_bits: int = 16,
    max_context: int | None = None,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids`; see the module docstring for the exact definition."""
    stride = default_stride(context) if stride is None else stride
    check_window(context, stride, max_context)
    started = time.perf_counter()
    nlls, windows = token_nlls(model, token_ids, context, stride, kv_bits)
    seconds = time.perf_counter() - started
    mean_nll = float(nlls.mean())
    return PerplexityResult(
        perplexity=math.exp(mean_nll),
        mean_nll=mean_nll,
        num_scored=int(nlls.size),
        num_evaluated=sum(w.end - w.start for w in windows),
        num_windows=len(windows),
        context=context,
        stride=stride,
        kv_bits=kv_bits,
        seconds=seconds,
    )


def read_text(path: Path) -> str:
    """The text of a UTF-8 file, with a clear error when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PerplexityError(f"{path}: cannot read the text ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise PerplexityError(f"{path}: not UTF-8 text") from None
