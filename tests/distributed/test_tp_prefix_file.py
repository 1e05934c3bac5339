"""A tensor-parallel group keeps its prefix cache across restarts: rank R of N in FILE.tpR.

Rank 0 decides when every rank saves (its save interval, and as the group stops); a group
started on those files hits the saved prompt on its first request and answers as one process
does. The blocks restored are the same on every rank: one rank's file missing, corrupt or saved
for another group size or model makes every rank start empty, with one warning on rank 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from baselm.distributed.tp.persist import blocks_payload, payload_blocks, rank_prefix_file
from baselm.distributed.tp.plan import LOAD, SAVE, StepPlan
from tests.api.test_serve import ServeProcess
from tests.tiny_model import write_model_folder

ROOT = Path(__file__).resolve().parents[2]
IGNORED = "every rank starts with an empty cache"


def run(folder: Path, file: Path, size: int, shift: int = 0) -> tuple[dict, str]:
    """One life of a group of `size` ranks on `file` (tests/distributed/tp_prefix_ranks.py): (result, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.tp_prefix_ranks", str(folder), str(file), str(size), str(shift)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def saved(folder, tmp_path_factory) -> tuple[Path, dict]:
    """The files a first pair of ranks left, and what it answered (nothing to hit then)."""
    file = tmp_path_factory.mktemp("saved") / "p.kvc"
    first, errors = run(folder, file, 2)
    assert first["hits"] == 0 and IGNORED not in errors
    assert sorted(p.name for p in file.parent.iterdir()) == ["p.kvc.tp0", "p.kvc.tp1"]
    return file, first


def copied(saved: tuple[Path, dict], tmp_path: Path) -> Path:
    for path in saved[0].parent.iterdir():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / saved[0].name


def test_each_rank_has_its_own_file_and_a_plan_carries_block_ids_and_full_hashes() -> None:
    assert rank_prefix_file("/data/p.kvc", 1) == Path("/data/p.kvc.tp1")
    hashes = [2**128 - 1, 0, 0x0123456789ABCDEF_FEDCBA9876543210]
    payload = blocks_payload([5, 0, 9], hashes)
    assert payload_blocks(payload) == ([5, 0, 9], hashes)
    for op in (SAVE, LOAD):
        plan = StepPlan.decode(StepPlan(op, cache_id=3, payload=payload).encode())
        assert (plan.op, plan.cache_id) == (op, 3) and np.array_equal(plan.payload, payload)
    empty = StepPlan.decode(StepPlan(LOAD, cache_id=1, payload=blocks_payload([], [])).encode())
    assert payload_blocks(empty.payload) == ([], [])


def test_a_restarted_pair_hits_its_files_first_and_answers_as_one_process(folder, saved, tmp_path) -> None:
    file = copied(saved, tmp_path)
    second, errors = run(folder, file, 2)
    assert second["hits"] == 64 and second["queries"] == 69  # 4 full blocks of 16, restored on both ranks
    assert IGNORED not in errors
    alone, _ = run(folder, tmp_path / "alone.kvc", 1)
    assert saved[1]["tokens"] == second["tokens"] == alone["tokens"]


def spoil(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # in the K/V: its checksum fails
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, verdict",
    [
        (lambda file: spoil(rank_prefix_file(str(file), 1)), "rank 0: usable; rank 1: unusable"),
        (lambda file: rank_prefix_file(str(file), 0).unlink(), "rank 0: no file; rank 1: usable"),
    ],
)
def test_one_ranks_file_spoiled_or_missing_starts_every_rank_empty(folder, saved, tmp_path, damage, verdict) -> None:
    file = copied(saved, tmp_path)
    damage(file)
    result, errors = run(folder, file, 2)
    assert result["hits"] == 0  # rank 0 holds a usable file, yet restored nothing: never a mix
    assert errors.count(IGNORED) == 1 and verdict in errors
    assert result["tokens"] == saved[1]["tokens"]
    again, _ = run(folder, file, 2)  # the stop wrote both files afresh
    assert again["hits"] == 64


def test_a_rank_left_with_an_older_file_starts_every_rank_empty(folder, saved, tmp_path) -> None:
    file = copied(saved, tmp_path)
    older = rank_prefix_file(str(file), 1).read_bytes()
    other, _ = run(folder, file, 2, shift=100)  # another prompt: both files now hold its blocks too
    rank_prefix_file(str(file), 1).write_bytes(older)  # as if rank 1's last save had failed
    result, errors = run(folder, file, 2)
    assert result["hits"] == 0 and errors.count(IGNORED) == 1
    assert "rank 0: usable; rank 1: holds other blocks than rank 0's" in errors
    assert result["tokens"] == saved[1]["tokens"] != other["tokens"]


def test_files_of_a_pair_are_refused_by_one_process_four_ranks_and_another_model(folder, saved, tmp_path) -> None:
    file = copied(saved, tmp_path)
    alone, errors = run(folder, file, 1)
    assert alone["hits"] == 0 and f"{file}.tp0 is there: a --tensor-parallel group saved it" in errors
    four, errors = run(folder, file, 4)  # 2 KV heads: each held by 2 of the 4 ranks
    assert four["hits"] == 0 and errors.count(IGNORED) == 1
    assert "rank 0: unusable" in errors and "rank 2: no file" in errors and "tensor_parallel differ" in errors
    other = write_model_folder(tmp_path / "other", max_position_embeddings=1024)  # the same layout, other files
    file = copied(saved, tmp_path / "other")
    result, errors = run(other, file, 2)
    assert result["hits"] == 0 and errors.count(IGNORED) == 1 and "weights differ" in errors
    assert alone["tokens"] == four["tokens"] == result["tokens"] == saved[1]["tokens"]


LONG = " ".join(f"word{i % 37}" for i in range(120))  # a prompt of several full KV blocks


def test_a_served_pair_restarted_on_its_files_reports_cached_prompt_tokens(folder, tmp_path) -> None:
    args = ("--tensor-parallel", "2", "--prefix-cache-file", str(tmp_path / "p.kvc"), "--kv-memory", "8MiB")
    body = {"model": "m", "prompt": LONG, "max_tokens": 6, "temperature": 0}
    answers = []
    for _ in range(2):
        served = ServeProcess(folder, "--served-model-name", "m", *args)
        try:
            answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(30) == 0
        finally:
            served.close()
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and cached[1] >= 16 * (answers[1]["usage"]["prompt_tokens"] // 16 - 1)
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kvc.tp0", "p.kvc.tp1"]


def files_appear(paths: list[Path], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_ranks_joined_from_a_hostfile_each_keep_their_file_where_their_command_says(folder, tmp_path, request) -> None:
    from baselm.distributed.group import reserve_ports, write_hostfile

    reserved = reserve_ports(2)  # held for the hostfile's ranks until the test ends
    request.addfinalizer(reserved.release)
    hostfile = write_hostfile(tmp_path, [f"127.0.0.1:{p}" for p in reserved.ports])
    common = ("--hostfile", str(hostfile), "--kv-memory", "8MiB", "--prefix-cache-save-interval", "0.2")
    homes = [tmp_path / "host0", tmp_path / "host1"]  # each rank's machine
    body = {"model": "m", "prompt": LONG, "max_tokens": 6, "temperature": 0}
    cached = []
    for _ in range(2):
        rank1 = subprocess.Popen(
            [sys.executable, "-m", "baselm.cli", "serve", str(folder), *common, "--rank", "1"]
            + ["--prefix-cache-file", str(homes[1] / "p")],
            cwd=ROOT,
            stderr=subprocess.PIPE,
        )
        served = ServeProcess(
            folder, "--served-model-name", "m", *common, "--rank", "0", "--prefix-cache-file", str(homes[0] / "p")
        )
        try:
            answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            if not cached[1:]:  # rank 0's save interval has every rank write its file, before any stop
                assert files_appear([homes[0] / "p.tp0", homes[1] / "p.tp1"]), list(tmp_path.rglob("*"))
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(30) == 0
        finally:
            served.close()
        rank1.communicate(timeout=60)
        assert [sorted(p.name for p in home.iterdir()) for home in homes] == [["p.tp0"], ["p.tp1"]]
    assert cached[0] == 0 and cached[1] > 0
