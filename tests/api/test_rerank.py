"""POST /v1/rerank against transformers' scores: a tiny random causal-LM reranker with Qwen2.5's
vocabulary (tests/fixtures/rerank_reference.json, from tests/tools/make_rerank_reference.py), tiny
random *ForSequenceClassification checkpoints (tests/fixtures/rerankers/, from
tests/tools/make_rerank_fixtures.py) and a Qwen3-Reranker GGUF with llama.cpp's classification head
(tests/rerank_files.py; its reference from make_rerank_reference.py too)."""

from __future__ import annotations

import json
import math

import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from baselm.rerank import DEFAULT_INSTRUCTION, prompt_ids, ranker_for
from tests.api.conftest import RunningServer
from tests.paths import FIXTURES
from tests.rerank_files import qwen3_reranker_gguf
from tests.toolcalls.qwen_vocab import qwen25_tool_gguf

REFERENCE = json.loads((FIXTURES / "rerank_reference.json").read_text())
NAME = "tiny-Qwen3-Reranker"


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, llama_cpp_models):
    path = qwen25_tool_gguf(tmp_path_factory.mktemp("rerank") / f"{NAME}.gguf", llama_cpp_models)
    running = RunningServer(loaded=load_model(str(path), select_backend("cpu")), model_name=NAME)
    yield running
    running.stop()


def _rerank(server, path: str = "/v1/rerank", **body):
    body = {"model": NAME, "query": REFERENCE["query"], "documents": REFERENCE["documents"], **body}
    return server.http().post(path, json=body)


def test_scores_match_transformers_on_the_same_file_and_come_best_first(reranker):
    tokenizer = reranker.engine.tokenizer
    ids = [prompt_ids(tokenizer, REFERENCE["query"], d) for d in REFERENCE["documents"]]
    assert ids == REFERENCE["prompt_ids"]  # the prompt transformers scored
    answer = _rerank(reranker).json()
    results = answer["results"]
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    by_index = {r["index"]: r["relevance_score"] for r in results}
    for i, (yes, no) in enumerate(REFERENCE["logits"]):
        ours = by_index[i]
        assert math.isclose(math.log(ours / (1 - ours)), yes - no, abs_tol=2e-3), (i, ours, yes - no)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, REFERENCE["prompt_ids"]))


def test_top_n_documents_and_the_other_paths(reranker):
    documents = [{"text": d} for d in REFERENCE["documents"]]  # Jina's and Cohere v2's shape
    whole = _rerank(reranker).json()["results"]
    for path in ("/rerank", "/v2/rerank"):
        top = _rerank(reranker, path, documents=documents, top_n=2, return_documents=True).json()["results"]
        assert [r["index"] for r in top] == [r["index"] for r in whole[:2]]
        assert [r["document"]["text"] for r in top] == [REFERENCE["documents"][r["index"]] for r in top]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": []}, "documents"),
        ({"documents": ["ok", 3]}, "documents"),
        ({"top_n": 0}, "top_n"),
        ({"query": None}, "query"),
    ],
)
def test_bad_requests_are_clear_400s(reranker, body, param):
    response = _rerank(reranker, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_model_that_is_no_reranker_is_a_400_naming_it(server):
    response = server.http().post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(
        "tiny is not a reranker: it has no classification head"
    )


# ---- rerankers with a classification head, known by what they are (their names say nothing) ----------

RERANKERS = FIXTURES / "rerankers"
CLASSIFIERS = ("qwen3", "llama", "gemma2")  # HF *ForSequenceClassification folders, transformers' scores beside
HEAD_GGUF = json.loads((RERANKERS / "qwen3-gguf.json").read_text())
SCORE_TOLERANCE = 1e-5  # float32 against transformers' float32


@pytest.fixture(scope="module", params=CLASSIFIERS)
def classifier(request):
    folder = RERANKERS / request.param
    running = RunningServer(loaded=load_model(folder, select_backend("cpu")), model_name=f"tiny-{request.param}")
    running.reference = json.loads((folder / "reference.json").read_text())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def head_gguf(tmp_path_factory, llama_cpp_models):
    """The Qwen3-Reranker GGUF as llama.cpp's converter writes it (tests/rerank_files.py)."""
    path = qwen3_reranker_gguf(tmp_path_factory.mktemp("head") / "tiny-qwen3-head.gguf", llama_cpp_models)
    running = RunningServer(loaded=load_model(str(path), select_backend("cpu")), model_name="tiny-qwen3-head")
    yield running
    running.stop()


def _scores(answer: dict) -> dict[int, float]:
    return {r["index"]: r["relevance_score"] for r in answer["results"]}


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/rerank", "strings"), ("/rerank", "objects"), ("/v2/rerank", "objects")],  # llama-server, Jina, Cohere
)
def test_a_classifier_ranks_with_its_head_as_transformers_scores_it(classifier, path, shape):
    reference = classifier.reference
    documents = [{"text": d} for d in reference["documents"]] if shape == "objects" else reference["documents"]
    body = {"model": classifier.model_name, "query": reference["query"], "documents": documents}
    answer = classifier.http().post(path, json=body).json()
    scores = _scores(answer)
    assert list(scores) == sorted(scores, key=lambda i: -reference["scores"][i])  # best first
    for i, expected in enumerate(reference["scores"]):
        assert math.isclose(scores[i], expected, abs_tol=SCORE_TOLERANCE), (i, scores[i], expected)
    assert answer["model"] == classifier.model_name and answer["object"] == "list"


def test_a_classifier_answers_top_n_with_its_documents(classifier):
    reference = classifier.reference
    body = {"model": classifier.model_name, "query": reference["query"], "documents": reference["documents"]}
    whole = classifier.http().post("/v1/rerank", json=body).json()["results"]
    top = classifier.http().post("/v1/rerank", json={**body, "top_n": 2, "return_documents": True}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in whole[:2]]
    assert [r["document"]["text"] for r in top] == [reference["documents"][r["index"]] for r in top]
    assert all("document" not in r for r in whole)


def test_a_classifier_reads_each_pair_as_transformers_encodes_it_up_to_its_last_token_not_padding(classifier):
    reference, name = classifier.reference, classifier.model_name
    loaded = classifier.engine.loaded
    ranker = ranker_for(name, loaded.config, loaded.tokenizer)
    read = [ranker.prompt_ids(reference["query"], d) for d in reference["documents"]]
    if name == "tiny-qwen3":  # its last document ends with the padding token, which transformers reads past
        assert read == [*reference["pair_ids"][:-1], reference["pair_ids"][-1][:-1]]
    else:
        assert read == reference["pair_ids"]
    body = {"model": name, "query": reference["query"], "documents": reference["documents"]}
    usage = classifier.http().post("/v1/rerank", json=body).json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, read))


def test_a_classifier_that_reads_plain_pairs_takes_no_instruction(classifier):
    body = {"model": classifier.model_name, "query": "q", "documents": ["d"], "instruction": "Find code"}
    response = classifier.http().post("/v1/rerank", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "instruction"


def test_a_classifier_writes_no_text_and_says_where_it_ranks(classifier):
    name = classifier.model_name
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"model": name, "prompt": "hi"}),
        ("/api/chat", {**chat, "stream": False}),
        ("/api/generate", {"model": name, "prompt": "hi", "stream": False}),
    ):
        response = classifier.http().post(path, json=body)
        message = response.json()["error"]
        message = message["message"] if isinstance(message, dict) else message
        assert response.status_code == 400, path
        assert message == (
            f"{name} is a reranker with a classification head: it ranks documents (POST /v1/rerank on `base serve`) "
            "and writes no text"
        )


def test_a_gguf_with_llama_cpps_rerank_head_scores_as_llama_server_defines_it(head_gguf):
    body = {"model": "tiny-qwen3-head", "query": HEAD_GGUF["query"], "documents": HEAD_GGUF["documents"]}
    answer = head_gguf.http().post("/v1/rerank", json=body).json()
    scores = _scores(answer)
    for i, expected in enumerate(HEAD_GGUF["scores"]):  # P(yes) of the twin's LM head, by transformers
        assert math.isclose(scores[i], expected, abs_tol=SCORE_TOLERANCE), (i, scores[i], expected)
    for i, expected in enumerate(HEAD_GGUF["llama_server_scores"]):  # its /rerank on the same file
        assert math.isclose(scores[i], expected, abs_tol=5e-4), (i, scores[i], expected)  # float16 activations there
    assert answer["usage"]["prompt_tokens"] == sum(map(len, HEAD_GGUF["prompt_ids"]))


def test_a_gguf_rerank_head_reads_the_files_rerank_template_as_llama_server_fills_it(head_gguf):
    loaded = head_gguf.engine.loaded
    ranker = ranker_for("tiny-qwen3-head", loaded.config, loaded.tokenizer)
    for document, ids in zip(HEAD_GGUF["documents"], HEAD_GGUF["prompt_ids"]):
        assert ranker.prompt_ids(HEAD_GGUF["query"], document) == ids  # as transformers tokenizes the filled template
    asked = loaded.tokenizer.decode(ranker.prompt_ids("q", "d", "Find the code that answers"))
    assert "<Instruct>: Find the code that answers\n<Query>: q\n<Document>: d<|im_end|>" in asked
    assert DEFAULT_INSTRUCTION not in asked
