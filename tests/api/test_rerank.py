"""POST /v1/rerank on a tiny random reranker with Qwen2.5's vocabulary, against transformers'
scores on the same file (tests/fixtures/rerank_reference.json, from tests/tools/make_rerank_reference.py)."""

from __future__ import annotations

import json
import math

import pytest

from baselm.backend import select_backend
from baselm.loader import load_model
from baselm.rerank import prompt_ids
from tests.api.conftest import RunningServer
from tests.paths import FIXTURES
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
    assert response.status_code == 400 and "tiny is not a reranker" in response.json()["error"]["message"]
