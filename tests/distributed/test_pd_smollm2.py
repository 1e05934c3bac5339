"""SmolLM2-135M (GGUF Q4_1) served by a 1:1 prefill/decode group answers like one process, token for token,
also answers that follow a JSON Schema and seeded copies."""

from __future__ import annotations

import json

import pytest

from baselm.backend import select_backend
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import load_model
from tests.distributed.pd_group import run_group
from tests.distributed.pd_rank import run_workload

CONFIG = {"kv_memory": 128_000_000, "max_num_batched_tokens": 64, "max_num_seqs": 8}
SYSTEM = "You are a helpful assistant. Answer in one short sentence, plainly and without lists."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is 2 plus 3?",
    "Which planet is called the red planet?",
    "What language is spoken in Spain?",
    "What is frozen water called?",
]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"type": "string", "maxLength": 12}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_smollm2_one_to_one_equals_one_process(smollm2_gguf) -> None:
    loaded = load_model(str(smollm2_gguf), select_backend("cpu"))
    requests = []
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        requests.append([i // 2, loaded.tokenizer.encode_chat(messages, add_generation_prompt=True), 24])
    json_ask = [{"role": "user", "content": "Name the capital of France as JSON with city and country."}]
    json_prompt = loaded.tokenizer.encode_chat(json_ask, add_generation_prompt=True)
    requests += [
        [1, json_prompt, 40, {"schema": CITY}],
        [2, requests[0][1], 16, {"n": 2, "seed": 7, "temperature": 0.8}],
    ]
    alone = run_workload(LLMEngine(loaded, EngineConfig(**CONFIG)), {"requests": requests})
    result = run_group(
        {"layout": "1:1", "model": str(smollm2_gguf), "config": CONFIG, "requests": requests}, timeout=600
    )
    assert result["tokens"] == alone["tokens"]
    assert set(json.loads(loaded.tokenizer.decode(result["tokens"]["r8"], skip_special_tokens=True))) == {
        "city",
        "country",
    }
    prefill, decode = result["stats"]
    assert decode["kv_blocks_hit"] > 0  # the shared system prompt's blocks were shipped once
    for rank in result["stats"]:
        assert rank["num_free_blocks"] == rank["num_blocks"]
