"""Entry point of every rank in the group tests: `python -m tests.distributed.group_ranks SCENARIO [ARGS]`.

Run by a person (or a test) it is rank 0: it starts rank 1 itself (`dist.form`), runs the
scenario on both ranks and prints one JSON line with what rank 0 saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import mlx.core as mx
import numpy as np

import baselm  # noqa: F401  first: the BLAS before mlx.core
from baselm import distributed as dist


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


SCENARIOS = {"broadcast": broadcast, "peer_exits": peer_exits}


def main() -> None:
    name, *rest = sys.argv[1:]
    if name == "join":  # join HOSTFILE RANK: a rank of a user's hostfile
        group = dist.join(rest[0], int(rest[1]))
        name = "broadcast"
    else:
        group = dist.form([sys.executable, "-m", "tests.distributed.group_ranks", name], 2)
    result = SCENARIOS[name](group)
    if group.rank == 0:
        print(json.dumps(result), flush=True)
        group.stop()


if __name__ == "__main__":
    main()
