"""Entry point of every rank in the group tests: `python -m tests.distributed.group_ranks SCENARIO [ARGS]`.

Run by a person (or a test) it is rank 0: it starts rank 1 itself (`dist.form`), runs the
scenario on both ranks and prints one JSON line with what rank 0 saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys

import mlx.core as mx
import numpy as np

import baselm  # noqa: F401  first: the BLAS before mlx.core
from baselm import distributed as dist
from baselm.distributed.pd import wire as pd_wire


def _digests(data: bytes, group) -> list[str]:
    """Every rank's SHA-256 of `data`, gathered on all ranks."""
    mine = mx.array(np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8))
    gathered = np.asarray(mx.distributed.all_gather(mine, group=group)).reshape(group.size(), 32)
    return [bytes(row).hex() for row in gathered]


def broadcast(group: dist.DistGroup) -> dict:
    """Payloads of several sizes (one collective and two) and a plain object reach every rank."""
    g = group.group
    result = {"bytes": {}}
    for size in (0, 10, dist.comm.INLINE_BYTES - 8, dist.comm.INLINE_BYTES, 100_000):
        data = bytes((i * 7 + size) % 256 for i in range(size)) if g.rank() == 0 else None
        got = dist.broadcast_bytes(data, g)
        want = bytes((i * 7 + size) % 256 for i in range(size))
        result["bytes"][str(size)] = {"same": got == want, "digests": _digests(got, g)}
    obj = {"tokens": [1, 2, 3], "name": "plan", "nested": {"x": 1.5, "ok": True, "none": None}}
    if g.rank() == 0:
        try:
            dist.broadcast_object({"bad": object()}, g)
        except dist.DistError as e:
            result["refused"] = str(e)
    got = dist.broadcast_object(obj if g.rank() == 0 else None, g)
    result["object_digests"] = _digests(json.dumps(got, sort_keys=True).encode(), g)
    result["object"] = got
    result["describe"] = group.describe()
    return result


def peer_exits(group: dist.DistGroup) -> dict:
    """Rank 1 exits after one collective; rank 0's next collective raises RankFailedError."""
    g = group.group
    mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))
    if g.rank() == 1:
        os._exit(3)
    try:
        dist.run_collective(mx.eval, mx.distributed.all_sum(mx.ones(4), group=g))
    except dist.RankFailedError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def _refusal(call) -> list[str] | None:
    """[exception type, message] of what `call()` raised, or None when it returned."""
    try:
        call()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None


def hostile_lengths(group: dist.DistGroup) -> dict:
    """Rank 1 is not this program: it adds one byte past the message limit to the length of rank
    0's broadcast, then announces a report one byte past it; rank 0 says how each call ended."""
    g = group.group
    too_long = dist.comm.MAX_MESSAGE_BYTES + 1
    if g.rank() == 1:
        first = np.zeros(dist.comm.INLINE_BYTES, dtype=np.uint8)  # the broadcast's first collective
        wanted, sent = (np.frombuffer(struct.pack("<Q", n), dtype=np.uint8) for n in (too_long, len(b"plan")))
        first[:8] = wanted - sent  # the all_sum adds bytes (modulo 256): rank 0's length becomes too_long
        mx.eval(mx.distributed.all_sum(mx.array(first), group=g))
        mx.eval(mx.distributed.all_gather(mx.array([too_long], dtype=mx.int32), group=g))  # the gather's lengths
        return {}
    return {
        "broadcast": _refusal(lambda: dist.broadcast_bytes(b"plan", g)),
        "gather": _refusal(lambda: pd_wire.gather(g, {"report": 1})),
    }


SCENARIOS = {"broadcast": broadcast, "peer_exits": peer_exits, "hostile_lengths": hostile_lengths}


def main() -> None:
    name, *rest = sys.argv[1:]
    if name == "join":  # join HOSTFILE RANK: a rank of a user's hostfile
        group = dist.join(rest[0], int(rest[1]))
        name = "broadcast"
    else:
        group = dist.form([sys.executable, "-m", "tests.distributed.group_ranks", name], 2)
    result = SCENARIOS[name](group)
    if group.rank == 0:
        folder = group.folder
        group.stop()
        result["hostfile_folder_left"] = folder is not None and folder.exists()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
