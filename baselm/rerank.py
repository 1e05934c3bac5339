"""Reranking with a causal-LM reranker (Qwen3-Reranker and the rerankers trained like it).

Such a model reads a query and one document in a fixed prompt and answers "yes" or "no"; the
document's relevance is the probability of "yes" against "no" at the first answer token:
`sigmoid(logit(yes) - logit(no))`, in (0, 1). Every document is one engine request of one token,
batched with whatever else runs, and the shared start of the prompts (the instruction and the
query come first) is prefix-cached after the first document.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from baselm.tokenizer.tokenizer import Tokenizer

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
_PREFIX = f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n"
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class RerankError(ValueError):
    """The model cannot rerank (or the request cannot be scored); the message says why."""


def is_reranker(*names: str) -> bool:
    """Whether a model is a reranker, by the names it goes by (Qwen3-Reranker-0.6B, bge-reranker, ...)."""
    return any("rerank" in name.lower() for name in names if name)


def answer_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of "yes" and "no", each one token in a reranker's vocabulary."""
    ids = []
    for word in ("yes", "no"):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise RerankError(f"this model's vocabulary spells {word!r} in {len(encoded)} tokens; it is no reranker")
        ids.append(encoded[0])
    return ids[0], ids[1]


def prompt_ids(tokenizer: Tokenizer, query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> list[int]:
    """The reranker's prompt for one (query, document) pair, as token ids."""
    text = f"{_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{_SUFFIX}"
    return tokenizer.encode(text, add_special_tokens=False)


def relevance(yes_logit: float, no_logit: float) -> float:
    """P(yes) of the two answers: softmax over (no, yes), taken at yes."""
    return 1.0 / (1.0 + math.exp(no_logit - yes_logit))


class AnswerLogits:
    """A logits processor that keeps the logits of the answer ids at the first answer token and
    changes nothing; one per request (its `values` are that request's)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.values: list[float] | None = None

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        if not output_ids and self.values is None:
            self.values = logits[mx.array(self.ids)].astype(mx.float32).tolist()
        return logits
