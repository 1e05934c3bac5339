"""More than one process: process groups over `mx.distributed`, rank-0 broadcasts, watchdogs.

`group.py` forms groups (local ranks on loopback, or a user's hostfile), `comm.py` carries
rank 0's data to every rank over collectives, `watchdog.py` ends a rank stuck on a peer.
`pd_*.py` split prefill and decode over processes (`base serve --pd P:D`; see pd_node.py).
"""

from baselm.distributed.comm import (
    MessageError,
    Traffic,
    all_sum,
    broadcast_bytes,
    broadcast_object,
    run_collective,
    traffic,
)
from baselm.distributed.group import (
    BACKENDS,
    DistError,
    DistGroup,
    RankFailedError,
    form,
    init,
    join,
    read_hostfile,
    start_local,
    write_hostfile,
)
from baselm.distributed.watchdog import Watchdog

__all__ = [
    "BACKENDS",
    "DistError",
    "DistGroup",
    "MessageError",
    "RankFailedError",
    "Traffic",
    "Watchdog",
    "all_sum",
    "broadcast_bytes",
    "broadcast_object",
    "form",
    "init",
    "join",
    "read_hostfile",
    "run_collective",
    "start_local",
    "traffic",
    "write_hostfile",
]
