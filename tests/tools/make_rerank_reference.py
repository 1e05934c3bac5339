"""Writes the reference scores of the GGUF rerankers the tests build, for tests/api/test_rerank.py:

- tests/fixtures/rerank_reference.json: a causal-LM reranker without a head (the tiny random model
  with Qwen2.5's vocabulary, tests/toolcalls/qwen_vocab.py). base builds each document's prompt ids
  (baselm/rerank.py); transformers, given the same GGUF and the same ids, computes the logits of
  "yes" and "no" at the last position, and the score from them.
- tests/fixtures/rerankers/qwen3-gguf.json: the Qwen3-Reranker GGUF with llama.cpp's `cls.output`
  head (tests/rerank_files.py). transformers reads no such head, so it scores the causal twin, the
  same model with its whole LM head: the prompt is the file's rerank template filled as llama-server
  fills it and tokenized by transformers, the score P(yes) against "no" at its last token; and
  llama-server's own /rerank answer for the file, recorded beside it.

    .venv/bin/python -m tests.tools.make_rerank_reference FIXTURES_PYTHON --llama-server BIN

FIXTURES_PYTHON is a Python with the `fixtures` extra (torch, transformers, accelerate); BIN a
llama-server of llama-cpp-python's vendored llama.cpp (tests/tools/bench_vs_llamacpp.py builds one
under base's home, `llama.cpp/VERSION-HASH/build/bin/`).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.paths import FIXTURES

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The Great Wall of China is thousands of kilometres long.",
    "Berlin is the capital of Germany.",
    "def capital(country):\n    return {'France': 'Paris'}[country]",
]
OUT = FIXTURES / "rerank_reference.json"
HEAD_OUT = FIXTURES / "rerankers" / "qwen3-gguf.json"

_HF = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
folder, name, job = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
config = AutoConfig.from_pretrained(folder, gguf_file=name)
if "head_dim" in job:  # transformers' GGUF reader drops qwen3's key_length
    config.head_dim = job["head_dim"]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
ids = job.get("ids") or [tokenizer(text, add_special_tokens=False)["input_ids"] for text in job["texts"]]
yes, no = job["yes_no"]
logits = []
with torch.no_grad():
    for row in ids:
        last = model(torch.tensor([row])).logits[0, -1]
        logits.append([float(last[yes]), float(last[no])])
print(json.dumps({"ids": ids, "logits": logits}))
"""


def _transformers(fixtures_python: str, path: Path, job: dict) -> dict:
    job_file = path.parent / "job.json"
    job_file.write_text(json.dumps(job))
    result = subprocess.run(
        [fixtures_python, "-c", _HF, str(path.parent), path.name, str(job_file)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def causal_reference(fixtures_python: str, models: Path) -> None:
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from baselm.rerank import answer_ids, prompt_ids, relevance
    from tests.toolcalls.qwen_vocab import qwen25_tool_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = qwen25_tool_gguf(Path(tmp) / "tiny-Qwen3-Reranker.gguf", models)
        tokenizer = load_model(str(path), select_backend("cpu")).tokenizer
        job = {"ids": [prompt_ids(tokenizer, QUERY, d) for d in DOCUMENTS], "yes_no": answer_ids(tokenizer)}
        logits = _transformers(fixtures_python, path, job)["logits"]
    reference = {
        "query": QUERY,
        "documents": DOCUMENTS,
        "prompt_ids": job["ids"],
        "yes_no_ids": job["yes_no"],
        "logits": logits,
        "scores": [relevance(yes, no) for yes, no in logits],
    }
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT}: scores {reference['scores']}")


def head_reference(fixtures_python: str, models: Path, llama_server: str) -> None:
    from baselm.rerank import relevance
    from tests.rerank_files import NO, QWEN3_FIXTURE, RERANK_TEMPLATE, YES, qwen3_reranker_gguf

    texts = [RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", d) for d in DOCUMENTS]
    head_dim = json.loads((QWEN3_FIXTURE / "config.json").read_text())["head_dim"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "twin").mkdir()
        (Path(tmp) / "head").mkdir()
        twin = qwen3_reranker_gguf(Path(tmp) / "twin" / "tiny-qwen3.gguf", models, with_head=False)
        answer = _transformers(fixtures_python, twin, {"texts": texts, "yes_no": [YES, NO], "head_dim": head_dim})
        head = qwen3_reranker_gguf(Path(tmp) / "head" / "tiny-qwen3-head.gguf", models)
        server_scores = _llama_server_scores(llama_server, head)
    reference = {
        "query": QUERY,
        "documents": DOCUMENTS,
        "prompt_ids": answer["ids"],
        "logits": answer["logits"],
        "scores": [relevance(yes, no) for yes, no in answer["logits"]],
        "llama_server_scores": server_scores,
    }
    HEAD_OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {HEAD_OUT}: scores {reference['scores']}, llama-server's {server_scores}")


def _llama_server_scores(binary: str, path: Path) -> list[float]:
    """llama-server's /v1/rerank relevance of each document, by index, for the reranker at `path`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [binary, "-m", str(path), "--rerank", "--port", str(port), "-c", "1024", "-t", "2", "-ngl", "0"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": len(DOCUMENTS)}
        results = httpx.post(f"{url}/v1/rerank", json=body, timeout=120).json()["results"]
    finally:
        server.terminate()
        server.wait(30)
    by_index = {r["index"]: r["relevance_score"] for r in results}
    return [by_index[i] for i in range(len(DOCUMENTS))]


def main() -> None:
    from tests.llama_cpp_files import fetch_models_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("fixtures_python")
    parser.add_argument("--llama-server", required=True, help="a llama-server binary, whose /rerank answer is recorded")
    args = parser.parse_args()
    models = fetch_models_dir()[0]
    causal_reference(args.fixtures_python, models)
    head_reference(args.fixtures_python, models, args.llama_server)


if __name__ == "__main__":
    main()
