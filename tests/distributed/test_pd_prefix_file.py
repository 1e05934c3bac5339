"""A prefill/decode group keeps its prefix cache across restarts: prefill rank R in FILE.prefillR.

A group saves when it stops and when rank 0 asks (its save interval); a group started on those
files hits the saved prompt on its first request and answers as one process does; a corrupt or
mismatched file is ignored with the warning one process gives, then replaced.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baselm.config import EngineConfig
from baselm.distributed.pd.prefill import rank_prefix_file
from baselm.engine import LLMEngine
from baselm.sampling.params import SamplingParams
from tests.distributed.pd_group import run_group
from tests.distributed.test_pd import CONFIG, single_process, workload
from tests.tiny_model import loaded_fixture

PROMPT = list(range(1, 70))  # 69 tokens: 4 full blocks of 16 (64 tokens the cache can serve) and 5 more


def group_spec(file: Path, requests: list[list], layout: str = "1:1", **changes) -> dict:
    config = {**CONFIG, "prefix_cache_file": str(file)}
    return {"layout": layout, "model": "fixture", "config": config, "requests": requests, **changes}


def test_each_prefill_rank_has_its_own_file_named_after_the_given_one() -> None:
    assert rank_prefix_file("/data/p.kvc", 0) == "/data/p.kvc.prefill0"
    assert rank_prefix_file("~/p", 3) == "~/p.prefill3"


def test_a_group_restarted_on_its_file_hits_the_saved_prompt_first_and_answers_as_one_process(tmp_path) -> None:
    requests = [[0, PROMPT, 8]]
    first = run_group(group_spec(tmp_path / "p.kvc", requests))
    assert first["files_before_stop"] == []  # saved as the group stopped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kvc.prefill0"]  # the decode rank keeps none
    assert first["stats"][0]["prefix_cache_hits"] == 0
    second = run_group(group_spec(tmp_path / "p.kvc", requests))
    prefill, decode = second["stats"]
    assert prefill["prefix_cache_hits"] == 64 and prefill["prefix_cache_queries"] == len(PROMPT)
    assert decode["prefix_cache_hits"] == 0  # what the decode rank held was not kept
    assert first["tokens"] == second["tokens"] == single_process(requests)["tokens"]
    assert first["exit_codes"] == second["exit_codes"] == [0, 0]


def test_two_prefill_ranks_save_their_own_files_when_asked_and_hit_them_after_a_restart(tmp_path) -> None:
    requests = workload(seed=1)
    spec = group_spec(tmp_path / "p.kvc", requests, layout="2:1", save_steps=[8])
    first = run_group(spec)
    assert first["files_before_stop"] == ["p.kvc.prefill0", "p.kvc.prefill1"]  # rank 0's plan asked both
    second = run_group(spec)
    hits = [sum(s["prefix_cache_hits"] for s in result["stats"][:2]) for result in (first, second)]
    assert second["stats"][1]["prefix_cache_hits"] > first["stats"][1]["prefix_cache_hits"]  # rank 1's own file
    assert hits[1] > hits[0]
    assert first["tokens"] == second["tokens"] == single_process(requests)["tokens"]


def test_when_the_decode_rank_dies_rank_0_saves_its_file_and_serves_on_alone_from_it(tmp_path) -> None:
    late = [[12, PROMPT, 4]]  # arrives after the decode rank died: the fallback engine serves it
    spec = group_spec(tmp_path / "p.kvc", [[0, PROMPT, 8], *late], kill_rank=[1, 4])
    result = run_group(spec, timeout=60)
    assert len(result["errors"]) == 1 and "prefill/decode group failed" in result["errors"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kvc.prefill0"]
    assert result["fallback_prefix_cache_hits"] == 64  # the prompt's blocks, from the file saved as the group failed
    assert result["tokens"]["r1"] == single_process(late)["tokens"]["r0"]


def saved_by_one_process(path: Path, **config) -> None:
    engine = LLMEngine(loaded_fixture("llama"), EngineConfig(**{**CONFIG, **config}, prefix_cache_file=str(path)))
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    engine.save_prefix_cache()


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (lambda path: path.write_bytes(path.read_bytes()[:-100]), "truncated or corrupt"),
        (lambda path: saved_by_one_process(path, kv_bits=8), "saved for another model or KV layout"),
    ],
    ids=["truncated", "other-kv-layout"],
)
def test_a_spoiled_file_is_ignored_with_a_warning_then_replaced(tmp_path, spoil, reason) -> None:
    path = tmp_path / "p.kvc.prefill0"
    saved_by_one_process(path)
    spoil(path)
    requests = [[0, PROMPT, 8]]
    result = run_group(group_spec(tmp_path / "p.kvc", requests))
    assert f"ignoring the prefix cache file {path}" in result["stderr"] and reason in result["stderr"]
    assert result["stats"][0]["prefix_cache_hits"] == 0
    assert result["tokens"] == single_process(requests)["tokens"]
    # the group wrote a good file in its place: one process (the same pool layout) loads and hits it
    engine = LLMEngine(loaded_fixture("llama"), EngineConfig(**CONFIG, prefix_cache_file=str(path)))
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.kv_manager.prefix_cache_hits == 64
