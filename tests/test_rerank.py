"""What makes a model a reranker and how its head's logits become a relevance (baselm/rerank.py), and
classifiers kept whole through `.base` files; the HTTP route is tests/api/test_rerank.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlx.core as mx
import pytest

from baselm.backend import Backend, select_backend
from baselm.loader import load_model
from baselm.models.base import ModelConfigError, classifier_labels
from baselm.rerank import HeadRanker, RerankError, ranker_for
from baselm.store.base_reader import read_base_file
from baselm.store.convert import convert
from baselm.tokenizer.tokenizer import Tokenizer
from tests.forward import prefill_logits
from tests.paths import BPE_TOKENIZER, FIXTURES
from tests.rerank_files import qwen3_reranker_gguf

RERANKERS = FIXTURES / "rerankers"
SEQ_CLS = {"architectures": ["Qwen3ForSequenceClassification"]}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(BPE_TOKENIZER)


@pytest.mark.parametrize(
    ("config", "labels"),
    [
        ({"architectures": ["Qwen3ForCausalLM"], "id2label": {"0": "LABEL_0"}}, None),
        ({}, None),
        ({**SEQ_CLS, "id2label": {"0": "LABEL_0"}}, ["LABEL_0"]),
        ({**SEQ_CLS, "id2label": {"1": "no", "0": "yes"}}, ["yes", "no"]),
        ({**SEQ_CLS, "num_labels": 3}, ["LABEL_0", "LABEL_1", "LABEL_2"]),
        (SEQ_CLS, ["LABEL_0", "LABEL_1"]),  # transformers' default: a config saved with two labels names none
    ],
)
def test_a_config_has_a_classification_head_only_as_a_sequence_classifier(config, labels):
    assert classifier_labels(config) == labels


def test_labels_numbered_other_than_0_to_n_are_refused():
    with pytest.raises(ModelConfigError, match=r"numbers its labels \[0, 2\], not 0 to n-1"):
        classifier_labels({**SEQ_CLS, "id2label": {"0": "a", "2": "b"}})


def test_a_one_label_head_gives_the_sigmoid_of_its_logit(tokenizer):
    ranker = HeadRanker("m", tokenizer, ["LABEL_0"], None, None)
    assert ranker.label_ids == [0]
    assert ranker.relevance([0.0]) == 0.5
    assert math.isclose(ranker.relevance([2.0]), 1 / (1 + math.exp(-2.0)), rel_tol=1e-15)
    assert math.isclose(ranker.relevance([-800.0]), 0.0, abs_tol=1e-300)  # no overflow far out


@pytest.mark.parametrize("labels", [["yes", "no"], ["no", "yes"]])
def test_a_yes_no_head_gives_the_probability_of_yes_whichever_row_holds_it(tokenizer, labels):
    ranker = HeadRanker("m", tokenizer, labels, None, None)
    logits = [3.0, 1.0] if labels[0] == "yes" else [1.0, 3.0]
    assert ranker.label_ids == [0, 1]
    assert math.isclose(ranker.relevance(logits), math.exp(3.0) / (math.exp(3.0) + math.exp(1.0)), rel_tol=1e-15)


@pytest.mark.parametrize(
    ("labels", "named"),
    [(["LABEL_0", "LABEL_1"], "2 labels (LABEL_0, LABEL_1)"), (["a", "b", "c"], "3 labels (a, b, c)")],
)
def test_a_head_whose_labels_give_no_relevance_is_refused_by_name(tokenizer, labels, named):
    with pytest.raises(RerankError, match=rf"^sentiment's classification head has {re.escape(named)}; a reranker"):
        HeadRanker("sentiment", tokenizer, labels, None, None)


def test_a_model_without_a_head_is_a_reranker_only_by_its_name(tokenizer):
    config = {"architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(RerankError, match=r"^chat-model is not a reranker: it has no classification head"):
        ranker_for("chat-model", config, tokenizer)
    with pytest.raises(RerankError, match="spells 'yes' in"):  # named a reranker, but no yes/no tokens to read
        ranker_for("my-reranker", config, tokenizer)


def test_padding_that_ends_a_pair_is_not_read(tokenizer):
    ranker = HeadRanker("m", tokenizer, ["LABEL_0"], 0, None)  # <|endoftext|> is id 0 here
    assert tokenizer.encode_pair("a", "b<|endoftext|><|endoftext|>")[-2:] == [0, 0]
    assert ranker.prompt_ids("a", "b<|endoftext|><|endoftext|>") == tokenizer.encode_pair("a", "b")


def _head_logits(path: Path, ids: list[int]) -> float:
    """The head's logit at the last of `ids` for the model at `path` (one label)."""
    return float(prefill_logits(load_model(str(path), select_backend("cpu")).model, ids)[-1, 0])


@pytest.mark.parametrize("quant", ["f32", "q8"])
def test_a_pulled_classifier_keeps_its_architecture_and_a_float_head(quant, tmp_path):
    folder = RERANKERS / "qwen3"
    reference = json.loads((folder / "reference.json").read_text())
    target = tmp_path / "qwen3.base"
    convert(folder, target, quant, None, "default")
    header, _ = read_base_file(target)
    assert header["config"]["architectures"] == ["Qwen3ForSequenceClassification"]
    score = next(t for t in header["tensors"] if t["name"] == "score.weight")
    assert score["dtype"] == "f32" and score["shape"] == [1, 32]
    ids = reference["pair_ids"][0]
    tolerance = 1e-5 if quant == "f32" else 0.1  # q8 rounds the body, not the head
    assert math.isclose(_head_logits(target, ids), reference["logits"][0][0], abs_tol=tolerance)


def test_a_pulled_gguf_rerank_head_is_kept_as_the_classifiers_score(tmp_path, llama_cpp_models):
    gguf_path = qwen3_reranker_gguf(tmp_path / "tiny-qwen3-head.gguf", llama_cpp_models)
    target = tmp_path / "tiny-qwen3-head.base"
    convert(gguf_path, target, None, None, "default")
    header, tensors = read_base_file(target)
    assert header["config"]["architectures"] == ["Qwen3ForSequenceClassification"]
    assert header["config"]["id2label"] == {"0": "yes", "1": "no"}
    assert "rerank" in header["tokenizer"]["gguf"]["tokenizer.chat_templates"]
    assert tensors["score.weight"].shape == (2, 64) and "lm_head.weight" not in tensors
    loaded = load_model(str(target), select_backend("cpu"))
    ranker = ranker_for("tiny-qwen3-head", loaded.config, loaded.tokenizer)
    ids = ranker.prompt_ids("What is the capital of France?", "Paris.")
    assert list(prefill_logits(loaded.model, ids)[-1]) == list(
        prefill_logits(load_model(str(gguf_path), select_backend("cpu")).model, ids)[-1]
    )


def test_a_quantized_gguf_rerank_head_ranks_alike_with_and_without_the_cpu_kernels(tmp_path, llama_cpp_models):
    # llama-quantize quantizes `cls.output` with the body; its rows then hold Q8_0's rounding.
    reference = json.loads((RERANKERS / "qwen3-gguf.json").read_text())
    path = qwen3_reranker_gguf(tmp_path / "tiny-qwen3-q8-head.gguf", llama_cpp_models, head_type="Q8_0")
    scores = {}
    for cpu_kernels in (True, False):
        backend = Backend("cpu", mx.float32, keep_quantized=True, cpu_kernels=cpu_kernels)
        loaded = load_model(str(path), backend)
        ranker = ranker_for("tiny-qwen3-q8-head", loaded.config, loaded.tokenizer)
        rows = [prefill_logits(loaded.model, ids)[-1] for ids in reference["prompt_ids"]]
        scores[cpu_kernels] = [ranker.relevance([float(x) for x in row]) for row in rows]
    assert scores[True] == pytest.approx(scores[False], abs=1e-5)
    assert scores[True] == pytest.approx(reference["scores"], abs=5e-3)
