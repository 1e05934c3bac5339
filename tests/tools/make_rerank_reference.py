"""Writes tests/fixtures/rerank_reference.json: transformers' reranking scores on the tiny random
model with Qwen2.5's vocabulary (tests/toolcalls/qwen_vocab.py), for tests/api/test_rerank.py.

    .venv/bin/python -m tests.tools.make_rerank_reference FIXTURES_PYTHON

FIXTURES_PYTHON is a Python with the `fixtures` extra (torch, transformers). base builds each
document's prompt ids (baselm/rerank.py); transformers, given the same GGUF and the same ids,
computes the logits of "yes" and "no" at the last position, and the score from them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.paths import FIXTURES

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The Great Wall of China is thousands of kilometres long.",
    "Berlin is the capital of Germany.",
    "def capital(country):\n    return {'France': 'Paris'}[country]",
]
OUT = FIXTURES / "rerank_reference.json"

_HF = """
import json, sys, torch
from transformers import AutoModelForCausalLM
folder, name, job = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
yes, no = job["yes_no"]
logits = []
with torch.no_grad():
    for ids in job["ids"]:
        last = model(torch.tensor([ids])).logits[0, -1]
        logits.append([float(last[yes]), float(last[no])])
print(json.dumps(logits))
"""


def main(fixtures_python: str) -> None:
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from baselm.rerank import answer_ids, prompt_ids, relevance
    from tests.llama_cpp_files import fetch_models_dir
    from tests.toolcalls.qwen_vocab import qwen25_tool_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = qwen25_tool_gguf(Path(tmp) / "tiny-Qwen3-Reranker.gguf", fetch_models_dir()[0])
        tokenizer = load_model(str(path), select_backend("cpu")).tokenizer
        job = {"ids": [prompt_ids(tokenizer, QUERY, d) for d in DOCUMENTS], "yes_no": answer_ids(tokenizer)}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        result = subprocess.run(
            [fixtures_python, "-c", _HF, tmp, path.name, str(Path(tmp) / "job.json")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    logits = json.loads(result.stdout.strip().splitlines()[-1])
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


if __name__ == "__main__":
    main(sys.argv[1])
