"""Starting a model over a tensor-parallel group, as the commands (`run`, `chat`, `serve`, `bench`) ask.

`load(ref, device, require_signature, dist)` forms the group `dist` describes, loads this rank's
shard and returns it with the group:
- on rank 0 the model is a `TensorParallelModel` (the command goes on as usual, and the other
  ranks follow each forward);
- on any other rank (a `--hostfile ... --rank R` process with R > 0) the caller runs
  `run_follower` until rank 0 stops, then ends the process with the status it returns.
With `--tensor-parallel N` and no hostfile, rank 0 starts ranks 1..N-1 itself on loopback
(`python -m baselm.distributed.tp.worker`), with the same model, device and checks.
One process alone never comes here: the commands load it with `baselm.loader.load_model`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from baselm.backend import select_backend
from baselm.distributed import group as groups
from baselm.distributed.comm import traffic
from baselm.distributed.group import STOP_GRACE_S, DistError, DistGroup
from baselm.distributed.tp.engine import STEP_TIMEOUT_S, TensorParallelModel, follow
from baselm.distributed.tp.layers import DEFAULT_MOE_SPLIT, Sharding
from baselm.distributed.tp.moe import MOE_SPLITS
from baselm.distributed.tp.persist import RankFile
from baselm.distributed.watchdog import Watchdog
from baselm.loader import LoadedModel, load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistOptions:
    """How many processes run the model and how they find each other."""

    tensor_parallel: int = 1  # ranks; 1: this process alone
    hostfile: str | None = None  # MLX's hostfile: the ranks are on the machines it lists
    rank: int | None = None  # this process's rank in the hostfile
    backend: str = "ring"
    step_timeout: float = STEP_TIMEOUT_S
    moe_split: str | None = None  # how MoE experts split (tp/moe.py MOE_SPLITS); None: the default
    prefix_cache_file: str | None = None  # --prefix-cache-file: rank R keeps FILE.tpR (tp/persist.py)

    def __post_init__(self) -> None:
        if self.moe_split is not None and self.moe_split not in MOE_SPLITS:
            raise DistError(f"--moe-split must be one of {', '.join(MOE_SPLITS)}, not {self.moe_split!r}")
        if self.tensor_parallel < 1:
            raise DistError(f"--tensor-parallel must be 1 or more, not {self.tensor_parallel}")
        if (self.hostfile is None) != (self.rank is None):
            raise DistError("--hostfile and --rank go together: each process says which rank of the file it is")
        if self.is_distributed:
            groups.check_backend(self.backend)

    @property
    def is_distributed(self) -> bool:
        return self.tensor_parallel > 1 or self.hostfile is not None


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a started rank loads: passed to `python -m baselm.distributed.tp.worker` as JSON."""

    model: str
    device: str
    require_signature: bool
    size: int
    backend: str
    step_timeout: float
    moe_split: str | None = None
    prefix_cache_file: str | None = None


def load(ref: str, device: str, require_signature: bool, dist: DistOptions) -> tuple[LoadedModel, DistGroup]:
    """This rank's shard of the model over the group `dist` describes, and the group (see the module
    doc); on rank 0 the model leads the others' forwards."""
    group = form_group(ref, device, require_signature, dist)
    loaded = load_shard(ref, device, require_signature, group, dist.moe_split)
    if group.rank == 0:
        loaded = lead(loaded, group, dist.step_timeout)
    return loaded, group


def form_group(ref: str, device: str, require_signature: bool, dist: DistOptions) -> DistGroup:
    """Joins the group of `dist.hostfile` as `dist.rank`, or (no hostfile) becomes rank 0 of a group on
    this machine and starts ranks 1..N-1 as workers that load `ref` the same way."""
    if dist.hostfile is not None:
        group = groups.join(dist.hostfile, dist.rank, dist.backend)
        if dist.tensor_parallel > 1 and dist.tensor_parallel != group.size:
            raise DistError(f"--tensor-parallel {dist.tensor_parallel} but the hostfile lists {group.size} ranks")
        return group
    spec = WorkerSpec(
        ref, device, require_signature, dist.tensor_parallel, dist.backend, dist.step_timeout, dist.moe_split
    )
    spec = replace(spec, prefix_cache_file=dist.prefix_cache_file)
    argv = [sys.executable, "-m", "baselm.distributed.tp.worker", json.dumps(asdict(spec))]
    return groups.start_local(argv, dist.tensor_parallel, dist.backend, env=share_cores(dist.tensor_parallel))


def share_cores(size: int) -> dict[str, str]:
    """Thread counts for `size` ranks on this machine: each takes its share of the cores for the
    CPU kernels and BLAS (set here for rank 0 too, before its kernels start), unless already set.
    Without this every rank would run a thread per core, and spinning workers of one rank would
    take the cores the others need."""
    threads = str(max(1, (os.cpu_count() or 1) // size))
    env = {name: os.environ.get(name, threads) for name in ("BASE_CPU_THREADS", "OPENBLAS_NUM_THREADS")}
    os.environ.setdefault("BASE_CPU_THREADS", threads)
    return env


def load_shard(
    ref: str, device: str, require_signature: bool, group: DistGroup, moe_split: str | None = None
) -> LoadedModel:
    """This rank's slice of the model (`moe_split`: how MoE experts split; None: the default)."""
    sharding = Sharding(group.rank, group.size, group.group, moe_split=moe_split or DEFAULT_MOE_SPLIT)
    loaded = load_model(ref, select_backend(device), require_signature=require_signature, shard=sharding)
    for note in sharding.notes:
        log.warning("tensor parallelism: %s", note)
    return loaded


def lead(loaded: LoadedModel, group: DistGroup, step_timeout: float = STEP_TIMEOUT_S) -> LoadedModel:
    """Rank 0: the model the engine runs sends each forward to the other ranks."""
    model = TensorParallelModel(loaded.model, group, step_timeout)
    atexit.register(release, model, group)
    loaded.model = model
    return loaded


def release(model: TensorParallelModel, group: DistGroup) -> None:
    """Rank 0's end of the group: at exit, or called before a command ends its process with
    `os._exit` (`base serve`), which runs no exit handlers. Tells the other ranks to stop, then
    waits for them to leave.

    A rank leaves its loop on the STOP plan, after the SAVE before it (the prefix cache file
    written as the server stops): a SIGTERM at once, or this process's exit (the ranks die with
    it), could cut that file short, and the next start would restore nothing (every rank needs its
    own usable file). Calling it again does nothing more."""
    model.stop()
    group.stop(grace=0.0 if model.failed is not None else STOP_GRACE_S)


def run_follower(
    loaded: LoadedModel, group: DistGroup, step_timeout: float = STEP_TIMEOUT_S, prefix_cache_file: str | None = None
) -> int:
    """A rank other than 0: follows rank 0 until it stops; returns the process's exit status: 0, or
    1 with a clear message when rank 0 is gone. With `prefix_cache_file` FILE it keeps its prefix
    cache in FILE.tpR, saved and loaded as rank 0's plans say."""
    files = RankFile(prefix_cache_file, loaded.path, group.rank, group.size)
    try:
        follow(loaded.model, group.group, Watchdog(step_timeout), files)
    except groups.RankFailedError as e:
        print(f"base: rank {group.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def describe(loaded: LoadedModel) -> dict[str, Any] | None:
    """The group, the split of a loaded model and what rank 0 moved so far (None when it is not
    distributed). Bytes are those rank 0 handed to collectives; a ring all-reduce of B bytes over
    N ranks puts 2(N-1)/N * B on each rank's link."""
    model = loaded.model
    if not isinstance(model, TensorParallelModel):
        return None
    tokens, forwards = max(model.num_tokens, 1), max(model.num_forwards, 1)
    return {
        **model.dist_group.describe(),
        "sharding": model.inner.sharding.describe(),
        "forwards": model.num_forwards,
        "tokens": model.num_tokens,
        "all_reduce_calls_per_forward": round(traffic.all_reduce_calls / forwards, 1),
        "all_reduce_bytes_per_token": round(traffic.all_reduce_bytes / tokens),
        "broadcast_bytes_per_forward": round(traffic.broadcast_bytes / forwards),
        "broadcast_calls_per_forward": round(traffic.broadcast_calls / forwards, 2),
    }
