"""Prefill/decode disaggregation on real groups of processes over loopback (MLX's ring backend).

Greedy answers from a group equal one process's token for token; aborts and a dying rank free
every block; the group moves only what the decode side lacks.
"""

from __future__ import annotations

import numpy as np

from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from tests.distributed.pd_group import run_group
from tests.distributed.pd_rank import run_workload
from tests.tiny_model import loaded_fixture

CONFIG = {"kv_memory": 4_000_000, "max_num_batched_tokens": 48, "max_num_seqs": 8}


def workload(seed: int = 0, num: int = 8) -> list[list]:
    """`num` staggered greedy requests: [arrival step, prompt ids, max_tokens]; every other one
    starts with the same 40-token prefix (longer than the 48-token step budget shares, so chunked)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 40).tolist()
    requests = []
    for i in range(num):
        prompt = rng.integers(0, 256, int(rng.integers(3, 30))).tolist()
        if i % 2 == 0:
            prompt = shared + prompt
        requests.append([i // 2, prompt, int(rng.integers(4, 12))])
    return requests


def single_process(requests: list[list], **config) -> dict:
    engine = LLMEngine(loaded_fixture("llama"), EngineConfig(**{**CONFIG, **config}))
    return run_workload(engine, {"requests": requests})


def assert_all_blocks_free(stats: list[dict]) -> None:
    for rank in stats:
        assert rank["num_free_blocks"] == rank["num_blocks"], rank
        assert rank["num_running"] == rank["num_waiting"] == rank["num_parked"] == 0, rank


def test_one_to_one_answers_equal_one_process_and_ship_only_missing_blocks() -> None:
    requests = workload()
    result = run_group({"layout": "1:1", "model": "fixture", "config": CONFIG, "requests": requests})
    assert result["tokens"] == single_process(requests)["tokens"]
    assert set(result["reasons"].values()) == {"length"}
    assert result["exit_codes"] == [0, 0]
    prefill, decode = result["stats"]
    assert_all_blocks_free(result["stats"])
    assert prefill["prompt_tokens_handed"] == sum(len(r[1]) for r in requests)
    assert decode["kv_blocks_hit"] > 0  # the shared prefix was shipped once, then hit on the decode side
    block_size = 16
    shipped = sum(-(-len(r[1]) // block_size) for r in requests) - decode["kv_blocks_hit"]
    assert prefill["kv_blocks_sent"] == shipped
    assert prefill["kv_bytes_sent"] == shipped * (prefill["kv_bytes_sent"] // prefill["kv_blocks_sent"])


def test_two_prefill_ranks_with_quantized_kv_and_speculative_decoding_equal_one_process() -> None:
    requests = workload(seed=1)
    config = {**CONFIG, "kv_bits": 4}
    result = run_group(
        {"layout": "2:1", "model": "fixture", "config": {**config, "speculative": "ngram"}, "requests": requests}
    )
    assert result["tokens"] == single_process(requests, kv_bits=4)["tokens"]
    assert result["exit_codes"] == [0, 0, 0]
    assert_all_blocks_free(result["stats"])
    assert result["stats"][1]["kv_blocks_sent"] > 0  # rank 1's packed q4 blocks reached rank 2
    assert result["stats"][0]["kv_blocks_sent"] > 0  # and rank 0's, relayed by rank 1 (route 0 -> 1 -> 2)
    assert result["stats"][2]["spec_num_draft_tokens"] > 0  # the decode rank verified drafts


def test_two_decode_ranks_share_the_requests_and_aborts_free_both_sides() -> None:
    requests = workload(seed=2) + [[2, list(range(1, 121)), 8]]  # r8: 120 prompt tokens, 48 a step
    aborts = {"8": 3, "4": 5}  # r8 while its prompt is half computed, r4 while it decodes
    result = run_group({"layout": "1:2", "model": "fixture", "config": CONFIG, "requests": requests, "abort": aborts})
    alone = single_process(requests)
    for i in range(len(requests)):
        if str(i) in aborts:
            assert result["reasons"][f"r{i}"] == "abort"
        else:
            assert result["tokens"][f"r{i}"] == alone["tokens"][f"r{i}"]
    assert result["exit_codes"] == [0, 0, 0]
    assert_all_blocks_free(result["stats"])
    assert all(rank["prefix_cache_queries"] > 0 for rank in result["stats"][1:])  # both decode ranks took requests


def test_a_dead_decode_rank_fails_its_requests_and_rank_0_serves_on_alone() -> None:
    requests = workload(seed=3)
    late = [[12, [7, 8, 9, 10], 5]]  # arrives after the decode rank died
    result = run_group(
        {"layout": "1:1", "model": "fixture", "config": CONFIG, "requests": requests + late, "kill_rank": [1, 4]},
        timeout=60,
    )
    assert len(result["errors"]) == 1 and "prefill/decode group failed" in result["errors"][0]
    assert result["tokens"]["r8"] == single_process(late)["tokens"]["r0"]
    free, total = result["fallback_free_blocks"]
    assert free == total


def test_a_hung_decode_rank_is_ended_by_the_watchdog_and_rank_0_serves_on_alone() -> None:
    requests = workload(seed=4, num=4)
    late = [[12, [7, 8, 9, 10], 5]]
    spec = {"layout": "1:1", "model": "fixture", "config": CONFIG, "requests": requests + late}
    result = run_group({**spec, "kill_rank": [1, 3, "SIGSTOP"], "step_timeout": 3.0}, timeout=60)
    assert len(result["errors"]) == 1 and "prefill/decode group failed" in result["errors"][0]
    assert result["tokens"]["r4"] == single_process(late)["tokens"]["r0"]
