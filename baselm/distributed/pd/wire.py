"""What the ranks of a prefill/decode group say to each other, over mx.distributed only.

Three verbs, each a collective every rank of the group calls in the same order:

- `broadcast`: rank 0's plan for the step reaches every rank (an all_sum where only rank 0
  contributes: lengths first, then the bytes).
- `gather`: every rank's report reaches every rank (all_gather of lengths, then of the
  reports padded to the longest).
- `transfer`: one buffer of KV bytes from a source rank to a destination rank. The ring
  backend connects each rank only to its two neighbours, so the bytes hop along the ring
  (src -> src+1 -> ... -> dst, modulo the size) with send/recv; the ranks in between relay
  them. Every rank knows each transfer's route and size from the step's plan, so each
  recv is posted with its shape up front.

Messages are JSON (pd_codec.py): a peer's bytes never run code here. A length a peer announces
is checked against the group's message limit (`comm.check_length`) before anything is
allocated for it; every rank sees the same lengths, so all of them refuse together.

Any failure of the group (a rank that died: "[ring] connection to a peer was lost") is raised
as the group layer's RankFailedError; after one, the group must not be used again (later
collectives can hang).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from baselm.distributed.comm import broadcast_bytes, check_length, run_collective
from baselm.distributed.pd import codec as pd_codec


def _run(array: mx.array) -> mx.array:
    return run_collective(lambda: mx.eval(array) or array)


def _to_bytes(obj: Any) -> mx.array:
    return mx.array(np.frombuffer(pd_codec.encode(obj), dtype=np.uint8))  # (len,)


def broadcast(group: mx.distributed.Group, obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass None)."""
    data = pd_codec.encode(obj) if group.rank() == 0 else None
    return pd_codec.decode(broadcast_bytes(data, group))


def gather(group: mx.distributed.Group, obj: Any) -> list[Any]:
    """Every rank's `obj`, by rank, on every rank."""
    data = _to_bytes(obj)
    lengths = _run(mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=group)).tolist()
    longest = max(check_length(n, f"a report from rank {r}") for r, n in enumerate(lengths))
    padded = mx.concatenate([data, mx.zeros((longest - data.size,), dtype=mx.uint8)]) if data.size < longest else data
    everyone = np.array(_run(mx.distributed.all_gather(padded, group=group))).tobytes()
    return [pd_codec.decode(everyone[r * longest : r * longest + n]) for r, n in enumerate(lengths)]


def route(src: int, dst: int, size: int) -> list[int]:
    """The ranks a transfer passes through, src first and dst last, going up the ring."""
    return [(src + i) % size for i in range((dst - src) % size + 1)]


def transfer(group: mx.distributed.Group, src: int, dst: int, nbytes: int, data: mx.array | None) -> mx.array | None:
    """Moves `nbytes` uint8 bytes from rank `src` (which passes them as `data`) to rank `dst`,
    relayed by the ranks between; returns them on `dst`, None elsewhere."""
    check_length(nbytes, f"a KV transfer from rank {src} to rank {dst}")
    rank = group.rank()
    path = route(src, dst, group.size())
    if rank not in path or src == dst:
        return data if rank == dst else None
    i = path.index(rank)
    if i > 0:
        data = _run(mx.distributed.recv((nbytes,), mx.uint8, path[i - 1], group=group))
    if i < len(path) - 1:
        _run(mx.distributed.send(data, path[i + 1], group=group))
    return data if rank == dst else None
