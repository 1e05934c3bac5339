"""Data from rank 0 to every rank over the group's collectives, and what the collectives moved.

There is no broadcast in `mx.distributed`, so rank 0 broadcasts by an `all_sum` where every
other rank adds zeros. `broadcast_bytes` sends the length and the first `INLINE_BYTES` of the
payload in one collective (a decode step's plan fits) and the rest, if any, in a second.
`broadcast_object` carries plain data (dicts, lists, str, int, float, bool, None) as JSON:
never pickle, which would run code a peer sends.

NOTE: a length read off the wire is a peer's word, and an all_sum adds every rank's bytes, so
any rank can change it. `check_length` holds it to `MAX_MESSAGE_BYTES` before anything is
allocated for it; every rank sees the same length, so every rank raises the same MessageError
at the same collective and none is left waiting for the next.

`traffic` counts the bytes handed to collectives (each rank's own buffer, not what the wire
carries: a ring all-reduce of B bytes over N ranks sends 2(N-1)/N * B per rank).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from baselm.distributed.group import DistError, RankFailedError, lost_peer

INLINE_BYTES = 4096  # one collective carries the length and this much payload
# The largest message a rank accepts from the group: a plan, a report, the blocks of one prompt.
# The largest real ones are a step's new prompts (a 128k-token prompt is ~1 MB of JSON).
MAX_MESSAGE_BYTES = 1 << 30
_HEADER = struct.Struct("<Q")

T = TypeVar("T")


class MessageError(RankFailedError):
    """A rank sent what no rank of this program sends (a length past the limit, bytes that do not
    decode, an index outside this rank's arrays): the group cannot be trusted to go on."""


def check_length(length: int, what: str) -> int:
    """`length` (bytes a peer announced for `what`) if 0 <= length <= MAX_MESSAGE_BYTES, else a MessageError."""
    if not 0 <= length <= MAX_MESSAGE_BYTES:
        raise MessageError(
            f"a rank announced {what} of {length} bytes; the limit is {MAX_MESSAGE_BYTES} "
            "(a rank of the group is not this program, or is broken; restart every rank)"
        )
    return length


@dataclass(slots=True)
class Traffic:
    """Bytes and calls handed to collectives by this process since `reset`."""

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    broadcast_bytes: int = 0
    broadcast_calls: int = 0

    def reset(self) -> None:
        self.all_reduce_bytes = self.all_reduce_calls = self.broadcast_bytes = self.broadcast_calls = 0


traffic = Traffic()


def all_sum(x: mx.array, group: Any) -> mx.array:
    """`mx.distributed.all_sum`, counted in `traffic` (lazily: counted when the graph is built)."""
    traffic.all_reduce_bytes += x.nbytes
    traffic.all_reduce_calls += 1
    return mx.distributed.all_sum(x, group=group)


def run_collective(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (which evaluates collectives); a lost peer becomes a RankFailedError."""
    try:
        return fn(*args)
    except RuntimeError as e:
        if lost_peer(e):
            raise RankFailedError(f"a rank of the group is gone ({e}); restart every rank") from e
        raise


def _summed(buf: np.ndarray, group: Any) -> np.ndarray:
    traffic.broadcast_bytes += buf.nbytes
    traffic.broadcast_calls += 1
    out = mx.distributed.all_sum(mx.array(buf), group=group)
    run_collective(mx.eval, out)  # NOTE: mx.eval lets other threads run while it waits
    return np.asarray(out)


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """Rank 0's `data` on every rank (others pass None). All ranks must call it together."""
    is_root = group.rank() == 0
    if is_root and data is None:
        raise DistError("rank 0 must give the bytes it broadcasts")
    first = np.zeros(INLINE_BYTES, dtype=np.uint8)  # (INLINE_BYTES,): length, then payload
    if is_root:
        head = _HEADER.pack(len(data)) + data[: INLINE_BYTES - _HEADER.size]
        first[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    first = _summed(first, group)
    (length,) = _HEADER.unpack(first[: _HEADER.size].tobytes())
    check_length(length, "a broadcast")
    if is_root and length != len(data):
        raise MessageError(f"the group changed rank 0's broadcast of {len(data)} bytes to {length}; restart every rank")
    inline = min(length, INLINE_BYTES - _HEADER.size)
    payload = first[_HEADER.size : _HEADER.size + inline].tobytes()
    rest = length - inline
    if rest:
        tail = np.zeros(rest, dtype=np.uint8)  # (rest,)
        if is_root:
            tail[:] = np.frombuffer(data[inline:], dtype=np.uint8)
        payload += _summed(tail, group).tobytes()
    return payload


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's plain-data `obj` (JSON-encodable) on every rank; others pass None."""
    data = None
    if group.rank() == 0:
        try:
            data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
        except (TypeError, ValueError) as e:
            raise DistError(f"only plain data (dict, list, str, number, bool, None) is broadcast: {e}") from e
    data = broadcast_bytes(data, group)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise MessageError(f"a broadcast of {len(data)} bytes is not JSON ({e}); restart every rank") from e
