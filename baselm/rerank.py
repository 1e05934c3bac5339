"""Reranking: documents scored for their relevance to a query by a model made to judge them.

What the model is decides how it ranks (`ranker_for`):

- A classifier (`HeadRanker`): a decoder with a classification head, HF's `*ForSequenceClassification`
  (the config's `architectures`: mxbai-rerank or Qwen3-Reranker converted to sequence classifiers,
  bge-reranker-style cross-encoders), or a GGUF with llama.cpp's `cls.output` head (Qwen3-Reranker
  as llama.cpp's converter writes it: the LM head's rows of "yes" and "no", pooling type RANK). Its
  logits are the head's, one per label, at the prompt's last token. The relevance of a one-label head
  is sigmoid(logit), as sentence-transformers' CrossEncoder reads it; of a yes/no head, the softmax
  at yes, as llama-server's /rerank returns it. The prompt is the model's `rerank` template with
  `{query}` and `{document}` filled in, where it has one (a GGUF's `tokenizer.chat_template.rerank`,
  as llama-server fills it); else the tokenizer's encoding of the (query, document) pair with its
  special tokens, as transformers' `tokenizer(query, document)` and CrossEncoder give it.
- A causal-LM reranker without a head (`AnswerRanker`: Qwen3-Reranker as released), known by its
  name: it reads the query and the document in a fixed prompt and answers "yes" or "no"; the
  relevance is the probability of "yes" against "no" at the first answer token.

Either way every document is one engine request of one token, batched with whatever else runs, its
scorer (`LabelLogits`) reading the logits it is chosen from; the shared start of the prompts (the
instruction and the query come first) is prefix-cached after the first document.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from baselm.models.base import classifier_labels
from baselm.tokenizer.tokenizer import Tokenizer

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
_PREFIX = f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n"
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_TEMPLATE = "rerank"  # the name of a model's rerank prompt among its chat templates


class RerankError(ValueError):
    """The model cannot rerank (or the request cannot be scored); the message says why."""


def is_reranker(*names: str) -> bool:
    """Whether a model is a reranker, by the names it goes by (Qwen3-Reranker-0.6B, bge-reranker, ...)."""
    return any("rerank" in name.lower() for name in names if name)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class Ranker(ABC):
    """How one model scores a (query, document) pair: the prompt it reads, the logits it is judged by
    (`label_ids`: vocabulary ids, or the rows of a classification head), and the relevance they give."""

    label_ids: list[int]

    @abstractmethod
    def prompt_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        """The prompt of one pair; `instruction` (None: the model's own) replaces the task it is given."""

    @abstractmethod
    def relevance(self, logits: Sequence[float]) -> float:
        """The document's relevance, in (0, 1), from the logits of `label_ids` at the prompt's last token."""


class AnswerRanker(Ranker):
    """A causal-LM reranker: P("yes") against "no" at the first answer token of a fixed prompt."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.label_ids = list(answer_ids(tokenizer))

    def prompt_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        return prompt_ids(self.tokenizer, query, document, instruction or DEFAULT_INSTRUCTION)

    def relevance(self, logits: Sequence[float]) -> float:
        return relevance(logits[0], logits[1])


class HeadRanker(Ranker):
    """A classifier: its head's logits at the last token of the prompt (see the module docstring).

    `pad_token_id`: transformers reads the head at the last token that is not padding, so trailing
    padding ids are left out of the prompt (a causal model's state there does not depend on them).
    """

    def __init__(
        self, name: str, tokenizer: Tokenizer, labels: Sequence[str], pad_token_id: int | None, template: str | None
    ) -> None:
        self.tokenizer, self.pad_token_id, self.template = tokenizer, pad_token_id, template
        self.label_ids = list(range(len(labels)))
        lowered = [label.lower() for label in labels]
        if len(labels) == 2 and sorted(lowered) == ["no", "yes"]:
            self._yes: int | None = lowered.index("yes")
        elif len(labels) == 1:
            self._yes = None
        else:
            raise RerankError(
                f"{name}'s classification head has {len(labels)} labels ({', '.join(labels)}); a reranker's head "
                "has one (a relevance logit) or two named yes and no"
            )

    def prompt_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        if self.template is None:
            if instruction is not None:
                raise RerankError("this model reads (query, document) pairs as they are and takes no instruction")
            ids = self.tokenizer.encode_pair(query, document)
        else:
            ids = self.tokenizer.encode(_filled(self.template, query, document, instruction), add_special_tokens=False)
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad_token_id:
            end -= 1
        return ids[:end]

    def relevance(self, logits: Sequence[float]) -> float:
        if self._yes is None:
            return sigmoid(logits[0])
        return relevance(logits[self._yes], logits[1 - self._yes])


def _filled(template: str, query: str, document: str, instruction: str | None) -> str:
    """A rerank template with the query and the document in it, replaced in that order as llama-server
    does (so a query that spells `{document}` gets the document there too); `instruction` replaces the
    default task, where the template states it."""
    if instruction is not None and instruction != DEFAULT_INSTRUCTION:
        if DEFAULT_INSTRUCTION not in template:
            raise RerankError("this model's rerank prompt states no instruction to replace; leave instruction out")
        template = template.replace(DEFAULT_INSTRUCTION, instruction)
    return template.replace("{query}", query).replace("{document}", document)


def ranker_for(name: str, config: Mapping[str, Any], tokenizer: Tokenizer, *other_names: str) -> Ranker:
    """How the model `name` ranks: by its classification head where it has one, else as a causal-LM
    reranker where its names say rerank; a RerankError naming it when it is neither."""
    labels = classifier_labels(config)
    if labels is not None:
        templates = tokenizer.chat_template
        template = templates.get(RERANK_TEMPLATE) if isinstance(templates, dict) else None
        return HeadRanker(name, tokenizer, labels, config.get("pad_token_id"), template)
    if is_reranker(name, *other_names):
        return AnswerRanker(tokenizer)
    raise RerankError(
        f"{name} is not a reranker: it has no classification head (a *ForSequenceClassification checkpoint, or a "
        "GGUF with a cls.output head) and its name does not say rerank; serve a reranker such as Qwen3-Reranker"
    )


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
    """A causal-LM reranker's prompt for one (query, document) pair, as token ids."""
    text = f"{_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{_SUFFIX}"
    return tokenizer.encode(text, add_special_tokens=False)


def relevance(yes_logit: float, no_logit: float) -> float:
    """P(yes) of the two answers: softmax over (no, yes), taken at yes."""
    return sigmoid(yes_logit - no_logit)


class LabelLogits:
    """A logits processor that keeps the logits of `ids` at the first answer token and changes nothing;
    one per request (its `values` are that request's)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.values: list[float] | None = None

    def __call__(self, output_ids: list[int], logits: mx.array) -> mx.array:
        if not output_ids and self.values is None:
            self.values = logits[mx.array(self.ids)].astype(mx.float32).tolist()
        return logits
