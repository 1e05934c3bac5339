"""A prefill/decode group serves what one process serves: answers that follow a JSON Schema (also
under speculative decoding), n > 1 copies with their seeds, logprobs and prompt logprobs; the
group's answers equal one process's, and every block is back on both sides afterwards, also
after aborting a request with several copies."""

from __future__ import annotations

import numpy as np

from baselm.config import EngineConfig, SpeculativeConfig
from baselm.engine import LLMEngine
from tests.distributed.pd_group import run_group
from tests.distributed.pd_rank import run_workload
from tests.distributed.test_pd import assert_all_blocks_free
from tests.tiny_model import loaded_widened_llama

CONFIG = {"kv_memory": 4_000_000, "max_num_batched_tokens": 48, "max_num_seqs": 8}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "bb"]}},
    "required": ["x", "tag"],
    "additionalProperties": False,
}


def workload() -> list[list]:
    """[arrival step, prompt ids, max_tokens, params] of requests that each need more than a handoff
    of one greedy answer: a schema, copies (seeded and greedy), logprobs, prompt logprobs."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 400, int(n)).tolist() for n in (9, 30, 21, 40, 12)]
    # Objects of the schema in the prompt: n-gram speculation proposes their tokens, the grammar checks them.
    prompts.append(loaded_widened_llama("tiny").tokenizer.encode('{"x":1,"tag":"a"} {"x":22,"tag":"bb"} {"x":'))
    return [
        [0, prompts[0], 40, {"schema": POINT}],
        [0, prompts[1], 10, {"n": 2, "seed": 11, "temperature": 1.0, "logprobs": 2}],
        [1, prompts[2], 6, {"prompt_logprobs": 3, "logprobs": 0}],
        [1, prompts[3], 30, {"n": 3, "seed": 3, "temperature": 0.8}],  # aborted while it decodes
        [2, prompts[4], 8, {"n": 2}],
        [2, prompts[5], 40, {"schema": POINT, "n": 2, "seed": 1, "temperature": 1.0}],
    ]


def single_process(requests: list[list], speculative: str | None) -> dict:
    config = EngineConfig(**CONFIG)
    if speculative:
        config.speculative = SpeculativeConfig.parse(speculative, 4, adaptive=False)
    return run_workload(LLMEngine(loaded_widened_llama("tiny"), config), {"requests": requests, "abort": ABORTS})


ABORTS = {"3": 6}


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert [t for t, _ in got[key]] == [t for t, _ in want[key]], key
        assert np.allclose([lp for _, lp in got[key]], [lp for _, lp in want[key]], atol=1e-4), key


def test_constrained_copies_and_prompt_logprobs_equal_one_process_and_free_every_block() -> None:
    requests = workload()
    config = {**CONFIG, "speculative": "ngram"}
    spec = {"layout": "1:1", "model": "widened", "config": config, "requests": requests, "abort": ABORTS}
    result = run_group(spec)
    alone = single_process(requests, "ngram")
    assert result["exit_codes"] == [0, 0]
    aborted = {k for k in alone["tokens"] if k.startswith("r3")}
    assert {k for k in result["tokens"] if k.startswith("r3")} == aborted == {"r3", "r3/1", "r3/2"}
    assert all(result["reasons"][k] == alone["reasons"][k] == "abort" for k in aborted)
    same = [k for k in alone["tokens"] if k not in aborted]
    assert {k: result["tokens"][k] for k in same} == {k: alone["tokens"][k] for k in same}
    assert {k: result["reasons"][k] for k in same} == {k: alone["reasons"][k] for k in same}
    assert result["tokens"]["r1"] != result["tokens"]["r1/1"]  # each copy draws with its own seed
    assert_close(result["prompt_logprobs"], alone["prompt_logprobs"])
    assert len(result["prompt_logprobs"]["r2"]) == len(requests[2][1]) - 1
    assert_close({k: result["logprobs"][k] for k in same}, {k: alone["logprobs"][k] for k in same})
    assert len(result["logprobs"]["r1/1"]) == len(result["tokens"]["r1/1"]) > 0
    assert_all_blocks_free(result["stats"])
    assert result["stats"][1]["spec_num_draft_tokens"] > 0  # the decode rank verified drafts under the grammar
