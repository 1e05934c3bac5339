"""`base serve MODEL --pd P:D`: one server over P prefill and D decode processes.

On one machine, the command a person starts is rank 0: it starts ranks 1..P+D-1 as copies of
its own command line on free loopback ports (group.form), every rank loads the model, and
rank 0 serves HTTP while the others follow its steps. Over machines, each rank is started by
hand (or by mlx.launch) with `--hostfile H --rank R` and the same model and options; rank 0
is the one with HTTP. `--role` states what a rank is meant to be and is checked against the
layout (ranks 0..P-1 prefill, P..P+D-1 decode), so a mistyped rank fails at start.
With `--prefix-cache-file FILE`, prefill rank R keeps its prefix cache in `FILE.prefillR`
(pd/prefill.py rank_prefix_file); decode ranks keep none.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baselm.api.server import run_server
from baselm.commands.model import load_alone
from baselm.config import ConfigError, EngineConfig
from baselm.distributed import group as dist_group
from baselm.distributed.pd.node import Layout, serve
from baselm.distributed.watchdog import Watchdog
from baselm.loader import LoadedModel

if TYPE_CHECKING:
    from baselm.commands.serve import ServeArgs
    from baselm.distributed.pd.engine import PDEngine
    from baselm.distributed.tp.launch import DistOptions

STEP_TIMEOUT_S = 120.0  # longer than any step (a full token budget of prefill on a slow CPU)


@dataclass(slots=True)
class PDOptions:
    """How a rank joins: the layout, and for ranks spread over machines, the hostfile and rank."""

    layout: Layout
    role: str | None = None  # "prefill" or "decode": checked against the layout
    hostfile: str | None = None
    rank: int | None = None

    @classmethod
    def parse(cls, pd: str, role: str | None, dist: DistOptions | None = None) -> PDOptions:
        """From --pd, --role and the parsed --hostfile/--rank/--tensor-parallel (None: none given)."""
        hostfile, rank = (dist.hostfile, dist.rank) if dist is not None else (None, None)
        if dist is not None and dist.tensor_parallel > 1:
            raise ConfigError("--pd and --tensor-parallel cannot be combined yet: choose one")
        if role not in (None, "prefill", "decode"):
            raise ConfigError(f"--role {role!r}: choose prefill or decode")
        return cls(Layout.parse(pd), role, hostfile, rank)


def form_group(options: PDOptions) -> dist_group.DistGroup:
    """This process's group: joined from a hostfile, or formed on loopback (rank 0 starts the rest)."""
    layout = options.layout
    if options.hostfile is not None:
        group = dist_group.join(options.hostfile, options.rank)
    else:
        group = dist_group.form([sys.executable, "-m", "baselm.cli", *sys.argv[1:]], layout.size)
    if group.size != layout.size:
        raise ConfigError(f"--pd {layout} needs {layout.size} ranks, but the hostfile lists {group.size}")
    if options.role is not None and options.role != layout.role(group.rank):
        raise ConfigError(
            f"rank {group.rank} is a {layout.role(group.rank)} rank under --pd {layout} "
            f"(ranks 0..{layout.num_prefill - 1} prefill, the rest decode), not {options.role}"
        )
    return group


def start(
    loaded: LoadedModel, config: EngineConfig, options: PDOptions, group: dist_group.DistGroup
) -> PDEngine | None:
    """Rank 0: its PDEngine, for the server. Any other rank: follows rank 0's steps until told to
    stop, then returns None (a failed group raises RankFailedError)."""
    from baselm.distributed.pd.engine import PDEngine
    from baselm.distributed.pd.launch import make_node, share_cores

    if options.hostfile is None:  # every rank on this machine
        share_cores(options.layout.size)
    node = make_node(loaded, config, options.layout, group.group)
    if group.rank != 0:
        serve(node)
        return None
    watchdog = None
    if group.children:  # a rank that hangs is ended, so the step fails over instead of hanging
        watchdog = Watchdog(STEP_TIMEOUT_S, on_expire=lambda what, seconds: group.stop(timeout=1.0))
    return PDEngine(node, loaded, config, on_failure=group.stop, watchdog=watchdog)


def serve_pd(args: ServeArgs) -> int:
    """`base serve --pd`: forms the group, loads the model on every rank, and on rank 0 serves HTTP
    until a signal; every other rank follows rank 0's steps. Returns this process's exit status."""
    group = form_group(args.pd)
    engine = None
    try:
        loaded = load_alone(args.model)
        engine = start(loaded, args.engine_config(), args.pd, group)
        if engine is None:  # a rank other than 0, told to stop
            return 0
        return run_server(loaded, engine.config, args.serve_options(), engine=engine)
    finally:
        stop(engine, group)


def stop(engine: PDEngine | None, group: dist_group.DistGroup) -> None:
    """After the server stopped (or failed to start): tells the other ranks to exit, then stops the
    ones this process started, given time to leave on their own once told: a prefill rank writes
    its prefix cache file as it stops, which a SIGTERM at once would cut short."""
    told = False
    try:
        told = engine is not None and engine.stop()
    except dist_group.RankFailedError:
        pass  # a rank already gone has nothing to stop
    group.stop(grace=dist_group.STOP_GRACE_S if told else 0.0)
