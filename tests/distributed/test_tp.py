"""Tensor parallelism over real 2-rank ring groups on loopback: the pair computes what one process does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from baselm.distributed.comm import MessageError
from baselm.distributed.group import reserve_ports, write_hostfile
from baselm.distributed.tp.layers import even_ranges, head_ranges
from baselm.distributed.tp.plan import CACHE, FORWARD, SAVE, StepPlan
from baselm.kv import AttentionMetadata
from baselm.models.base import ModelConfigError
from tests.distributed.tp_ranks import FIXTURES
from tests.paths import BPE_TOKENIZER, MODEL_FIXTURES
from tests.tiny_model import write_model_folder

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # float32 logits: the pair sums partial products in another order


def _ranks(*args: str, timeout: float = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.tp_ranks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_architecture_gives_the_same_logits_split_over_two_ranks():
    result = _ranks("logits")
    assert sorted(result) == FIXTURES
    for name, seen in result.items():
        assert seen["max_abs_diff"] < TOLERANCE, name
        assert seen["same_argmax"], name
    assert result["llama_rope3_mqa"]["sharding"]["kv_replicated"]  # 1 KV head, 2 ranks: both hold it
    assert not result["llama"]["sharding"]["kv_replicated"]


def test_quantized_weights_split_on_group_boundaries_give_the_same_logits():
    result = _ranks("quantized_logits")
    for path in ("kernels", "reference"):
        for name, seen in result[path].items():
            assert seen["max_abs_diff"] < TOLERANCE, (path, name)


def test_the_engine_over_two_ranks_answers_as_one_process_for_every_architecture():
    result = _ranks("engine")
    assert sorted(k.split("/")[0] for k in result) == FIXTURES
    for key, seen in result.items():
        assert seen["pair"]["token_ids"] == seen["whole"]["token_ids"], key
        pair, whole = np.array(seen["pair"]["embeddings"]), np.array(seen["whole"]["embeddings"])
        assert np.abs(pair - whole).max() < TOLERANCE, key


def test_quantized_kv_speculation_and_chunked_prefill_work_over_two_ranks():
    result = _ranks("engine_options")
    for key, seen in result.items():
        assert seen["pair"]["token_ids"] == seen["whole"]["token_ids"], key
    assert result["llama/ngram"]["pair"]["num_draft_tokens"] > 0  # the pair verified drafts


def test_moe_layers_split_either_way_give_the_same_logits_float_and_quantized():
    result = _ranks("moe_logits", timeout=300)
    assert len(result) == 2 * (4 + 2 * 2)  # two ways, four fixtures in float32, two of them in q4 and q8
    for key, seen in result.items():
        assert seen["max_abs_diff"] < TOLERANCE, key
        assert seen["same_argmax"], key
        assert seen["sharding"]["moe_split"] == key.split("/")[0]


def test_the_engine_over_two_ranks_answers_as_one_process_with_moe_split_either_way():
    result = _ranks("moe_engine", timeout=300)
    assert sorted(result) == ["experts", "intermediate"]
    for split, seen_by_key in result.items():
        assert len(seen_by_key) == 4 * 2  # four MoE fixtures, plain and with a q8 KV cache
        for key, seen in seen_by_key.items():
            assert seen["pair"]["token_ids"] == seen["whole"]["token_ids"], (split, key)


def test_a_killed_rank_fails_the_stream_and_later_requests_with_503(tmp_path: Path):
    folder = write_model_folder(tmp_path / "tiny")
    seen = _ranks("rank_dies", str(folder))
    assert seen["before"] == "length"
    # MLX's ring error ("a rank of the group is gone") or rank 0's check of the rank it started
    assert "restart every rank" in seen["stream_error"]
    for key in ("after", "again"):
        assert seen[key]["status"] == 503
        assert "restart every rank" in seen[key]["message"]


# ---- the split and the plan, without a group -----------------------------------------------


def test_ranges_split_evenly_on_units_first_ranks_taking_the_extra():
    assert even_ranges(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert even_ranges(96, 2, 32) == [(0, 64), (64, 96)]
    with pytest.raises(ModelConfigError, match="multiple of the quantization group size 32"):
        even_ranges(100, 2, 32)
    with pytest.raises(ModelConfigError, match="cannot be split over 2 ranks"):
        even_ranges(32, 2, 32)


def test_heads_follow_their_kv_heads_and_kv_heads_are_copied_when_too_few():
    assert head_ranges(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]  # SmolLM2-135M
    assert head_ranges(4, 1, 2) == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    assert head_ranges(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    with pytest.raises(ModelConfigError, match="cannot be split over 4 ranks"):
        head_ranges(6, 2, 4)


def test_a_step_plan_comes_back_as_the_same_attention_metadata():
    meta = AttentionMetadata.build([[3, 1], [0]], [5, 1], [20, 7], 16)
    ids = np.arange(6, dtype=np.int32)
    plan = StepPlan.decode(StepPlan.forward(FORWARD, ids, meta, 7).encode())
    assert (plan.op, plan.cache_id, plan.input_ids.tolist()) == (FORWARD, 7, ids.tolist())
    again = plan.metadata(16)
    for name in ("positions", "slot_mapping", "block_tables", "context_lens", "query_pos", "token_rows"):
        assert np.array_equal(np.array(getattr(again, name)), np.array(getattr(meta, name))), name
    cache = StepPlan.decode(StepPlan(CACHE, cache_id=2, cache_shape=(100, 16, 8)).encode())
    assert (cache.op, cache.cache_id, cache.cache_shape) == (CACHE, 2, (100, 16, 8))


def _forward_plan(block_tables: list[list[int]], input_ids: list[int]) -> StepPlan:
    lens = [len(input_ids)] * len(block_tables)
    meta = AttentionMetadata.build(block_tables, lens, lens, 16)
    return StepPlan.forward(FORWARD, np.asarray(input_ids * len(block_tables), dtype=np.int32), meta, 1)


def test_a_plan_naming_blocks_or_tokens_outside_this_rank_is_refused():
    _forward_plan([[3, 1]], [5] * 20).check(num_blocks=4, vocab_size=6)
    for plan, why in (
        (_forward_plan([[3, 4]], [5] * 20), "blocks 3..4 of a pool of 4"),
        (_forward_plan([[-1]], [5]), "blocks -1..-1"),
        (_forward_plan([[0]], [6]), "token ids 6..6, past a vocabulary of 6"),
        (StepPlan(SAVE, payload=np.array([9, 1, 2, 3, 4], dtype=np.int32)), "blocks 9..9"),
    ):
        with pytest.raises(MessageError, match=why):
            StepPlan.decode(plan.encode()).check(num_blocks=4, vocab_size=6)


@pytest.mark.parametrize(
    "header, why",
    [
        ([FORWARD, -1, 0, 1, 1, 0, 0, 0], "negative count"),
        ([FORWARD, 1, 1, 1, 1, 0, 0, 0], "holds 8 values, its header describes 12"),
        ([SAVE, 0, 3, 0, 1, 0, 0, 0, 1, 2, 3], "5 per block"),
        ([FORWARD, 1, 1, 1, 1, 0, 0, 0, 0, 0, 7, 0], "describes no step"),  # a query of 1 in a context of 0
    ],
)
def test_a_plan_whose_header_does_not_describe_it_is_refused(header: list[int], why: str):
    with pytest.raises(MessageError, match=why):
        StepPlan.decode(np.asarray(header, dtype="<i4").tobytes()).metadata(16)


def test_base_run_over_two_processes_started_or_joined_prints_what_one_process_prints(tmp_path: Path):
    folder = write_model_folder(tmp_path / "tiny")
    reserved = reserve_ports(2)  # held for the ranks of the hostfile, released at the end
    hostfile = write_hostfile(tmp_path, [f"127.0.0.1:{p}" for p in reserved.ports])
    args = [
        sys.executable,
        "-m",
        "baselm.cli",
        "run",
        str(folder),
        "Hello there",
        "-n",
        "12",
        "-t",
        "0",
        "--raw",
        "--device",
        "cpu",
    ]

    def run(*extra: str) -> list[int]:
        proc = subprocess.run([*args, "--json", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)["token_ids"]

    alone = run()
    assert len(alone) == 12
    assert run("--tensor-parallel", "2") == alone  # rank 0 starts rank 1 itself
    with reserved:
        rank1 = subprocess.Popen([*args, "--hostfile", str(hostfile), "--rank", "1"], cwd=ROOT, stdout=subprocess.PIPE)
        assert run("--hostfile", str(hostfile), "--rank", "0") == alone
        assert rank1.wait(60) == 0 and rank1.stdout.read() == b""  # it followed rank 0, then left quietly


def test_base_run_with_whole_experts_per_rank_prints_what_one_process_prints(tmp_path: Path):
    folder = tmp_path / "mixtral"
    shutil.copytree(MODEL_FIXTURES / "mixtral", folder)
    shutil.copy(BPE_TOKENIZER / "tokenizer.json", folder)
    args = [sys.executable, "-m", "baselm.cli", "run", str(folder), "Hi", "-n", "12", "-t", "0", "--raw", "--json"]

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*args, "--device", "cpu", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)

    alone = json.loads(run().stdout)["token_ids"]
    assert len(alone) == 12
    for split in ("experts", "intermediate"):
        proc = run("--tensor-parallel", "2", "--moe-split", split)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["token_ids"] == alone, split
    proc = run("--tensor-parallel", "2", "--moe-split", "rows")
    assert proc.returncode == 1
    assert "--moe-split must be one of experts, intermediate, not 'rows'" in proc.stderr
    proc = run("--tensor-parallel", "3", "--moe-split", "experts")  # 4 experts
    assert proc.returncode == 1
    assert "4 experts cannot be split evenly over 3 ranks" in proc.stderr


@pytest.mark.slow
def test_smollm2_over_two_ranks_gives_the_reference_tokens_to_the_end(smollm2_gguf):
    from tests.conftest import LOCAL_REFERENCE, REFERENCE

    reference = REFERENCE if REFERENCE.exists() else LOCAL_REFERENCE
    seen = _ranks("smollm2", str(smollm2_gguf), str(reference), timeout=300)
    assert len(seen["cases"]) == 8
    for case in seen["cases"]:
        expected = case["expected"]  # a reference may end early, at its eos
        assert case["token_ids"][: len(expected)] == expected
    reference_top5 = json.loads(reference.read_text())["cases"][0]["top5_logprobs_first4"][0]
    got = dict(map(tuple, seen["cases"][0]["first_top5"]))
    for token_id, logprob in reference_top5:
        assert abs(got[token_id] - logprob) < 1e-3
