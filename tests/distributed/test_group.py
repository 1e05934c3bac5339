"""Process groups: real 2-rank ring groups on loopback, started the ways `base` starts them."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from baselm import distributed as dist
from baselm.distributed.group import reserve_ports

ROOT = Path(__file__).resolve().parents[2]

RANKS = [sys.executable, "-m", "tests.distributed.group_ranks"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKS, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_broadcast_reaches_every_rank_at_every_size():
    result = _result(_run("broadcast"))
    for size, seen in result["bytes"].items():
        assert seen["same"], size
        assert len(set(seen["digests"])) == 1, size  # rank 1 received the same bytes
    assert result["object"] == {"tokens": [1, 2, 3], "name": "plan", "nested": {"x": 1.5, "ok": True, "none": None}}
    assert len(set(result["object_digests"])) == 1
    assert "plain data" in result["refused"]
    described = result["describe"]
    assert (described["backend"], described["rank"], described["size"]) == ("ring", 0, 2)
    assert all(h.startswith("127.0.0.1:") for h in described["hosts"])
    assert result["hostfile_folder_left"] is False  # the temporary hostfile rank 0 wrote is gone once it stops


def test_a_peer_that_exits_fails_the_next_collective_clearly():
    result = _result(_run("peer_exits"))
    assert result["error"] == "RankFailedError"
    assert "restart every rank" in result["message"]


def test_a_length_past_the_limit_from_a_peer_is_refused_before_anything_is_allocated():
    result = _result(_run("hostile_lengths"))
    limit = str(dist.comm.MAX_MESSAGE_BYTES)
    for call in ("broadcast", "gather"):
        error, message = result[call]
        assert error == "MessageError", (call, message)
        assert limit in message and "restart every rank" in message


def test_ranks_join_from_a_user_hostfile(tmp_path: Path):
    with reserve_ports(2) as reserved:  # the ranks bind them, nobody else
        hosts = [f"127.0.0.1:{p}" for p in reserved.ports]
        hostfile = dist.write_hostfile(tmp_path, hosts)
        rank1 = subprocess.Popen([*RANKS, "join", str(hostfile), "1"], cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            result = _result(_run("join", str(hostfile), "0"))
        finally:
            rank1.wait(30)
    assert result["describe"]["hosts"] == hosts
    assert all(seen["same"] for seen in result["bytes"].values())
    assert hostfile.exists()  # a user's hostfile is theirs: stopping leaves it


def test_a_rank_that_fails_to_start_is_reported_not_waited_for(tmp_path: Path):
    code = (
        "import sys; from baselm import distributed as dist; "
        "dist.start_local([sys.executable, '-c', 'raise SystemExit(3)'], 2, timeout=60)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "exited with status 3 before joining the group" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # the hostfile's temporary folder went with the failed group


# A started rank that, before it joins, tries to take rank 0's port with a plain socket (as any
# other program could) and writes what happened to the file named in its argv.
_GRAB_RANK_0_PORT = """
import errno, json, os, socket, sys
port = int(json.load(open(os.environ["MLX_HOSTFILE"]))[0][0].rsplit(":", 1)[1])
try:
    socket.socket().bind(("127.0.0.1", port))
    seen = "taken"
except OSError as e:
    seen = errno.errorcode[e.errno]
open(sys.argv[1], "w").write(seen)
raise SystemExit(3)
"""


def test_a_local_groups_ports_stay_reserved_until_its_ranks_bind_them(tmp_path: Path):
    seen = tmp_path / "seen"
    argv = [sys.executable, "-c", _GRAB_RANK_0_PORT, str(seen)]
    code = f"import sys; from baselm import distributed as dist; dist.start_local({argv!r}, 2, timeout=60)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "exited with status 3 before joining the group" in proc.stderr
    assert seen.read_text() == "EADDRINUSE"


def test_reserved_ports_refuse_other_sockets_and_admit_the_rings():
    def bind(port: int, reuse_port: bool) -> str:
        with socket.socket() as s:
            if reuse_port:  # as MLX's ring binds a rank's address
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                return errno.errorcode[e.errno]
            return "bound"

    with reserve_ports(2) as reserved:
        first, second = reserved.ports
        assert first != second
        assert bind(first, reuse_port=False) == "EADDRINUSE"
        assert bind(first, reuse_port=True) == "bound"
    assert bind(first, reuse_port=False) == "bound"  # released


def test_a_missing_peer_times_out_with_a_clear_error(tmp_path: Path):
    with reserve_ports(2) as reserved:
        hostfile = dist.write_hostfile(tmp_path, [f"127.0.0.1:{p}" for p in reserved.ports])
        code = f"from baselm import distributed as dist; dist.join({str(hostfile)!r}, 0, timeout=0.5)"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "Timeout" in proc.stderr  # faulthandler's report: MLX's ring init holds Python's lock


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "is not JSON"),
        ('[["127.0.0.1:1"]]', "at least 2"),
        ('[["127.0.0.1:1"], [3]]', "rank 1 is not a list"),
        ('[["127.0.0.1:1"], ["10.0.0.2"]]', "rank 1: '10.0.0.2' is not \"host:port\""),
        ('[["127.0.0.1:1"], ["10.0.0.2:70000"]]', "rank 1: '10.0.0.2:70000' is not"),
        ('[[":40100"], ["10.0.0.2:40100"]]', "rank 0: ':40100' is not"),
    ],
)
def test_bad_hostfiles_are_refused_clearly(tmp_path: Path, text: str, message: str):
    path = tmp_path / "hosts.json"
    path.write_text(text)
    with pytest.raises(dist.DistError, match=message):
        dist.read_hostfile(path)


@pytest.mark.parametrize("address, warned", [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_rank_told_to_listen_on_every_interface_is_warned_the_ring_has_no_authentication(
    tmp_path: Path, address: str, warned: bool
):
    with reserve_ports(2) as reserved:
        hosts = [f"{address}:{reserved.ports[0]}", f"127.0.0.1:{reserved.ports[1]}"]
        hostfile = dist.write_hostfile(tmp_path, hosts)
        code = f"from baselm import distributed as dist; dist.join({str(hostfile)!r}, 0, timeout=0.5)"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ("rank 0 listens on 0.0.0.0" in proc.stderr and "no authentication" in proc.stderr) == warned


def test_a_rank_outside_the_hostfile_is_refused(tmp_path: Path):
    hostfile = dist.write_hostfile(tmp_path, ["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(dist.DistError, match="rank 2 is outside"):
        dist.join(hostfile, 2)


def test_an_unknown_backend_is_refused():
    with pytest.raises(dist.DistError, match="unknown distributed backend 'tcp'"):
        dist.init("tcp")


def test_the_watchdog_fires_when_a_block_outlasts_its_deadline():
    fired: list[tuple[str, float]] = []
    done = threading.Event()

    def expire(what: str, timeout: float) -> None:
        fired.append((what, timeout))
        done.set()

    watchdog = dist.Watchdog(0.05, on_expire=expire)
    with watchdog.armed("step 7"):
        assert done.wait(10)
    assert fired == [("step 7", 0.05)]
