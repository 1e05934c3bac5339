"""The options of `base run/chat/serve/bench` that spread a model over several processes.

Declared once here and shared by the commands; parsed into `baselm.distributed.launch.DistOptions`
(imported lazily: MLX stays out of `base --help`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from baselm.config import EngineConfig
    from baselm.distributed.launch import DistOptions

TENSOR_PARALLEL = typer.Option(
    1,
    "--tensor-parallel",
    help="Split the model over N processes (tensor parallelism); without --hostfile, all on this machine.",
)
HOSTFILE = typer.Option(
    None, "--hostfile", help="MLX hostfile (JSON) of the processes' addresses, one per rank; with --rank."
)
RANK = typer.Option(None, "--rank", help="This process's rank in --hostfile (rank 0 serves; the others follow).")
MOE_SPLIT = typer.Option(
    None,
    "--moe-split",
    help="How MoE experts split over the ranks: experts (whole experts per rank) or intermediate "
    "(every expert sliced on every rank; the default, faster as measured: see README).",
)


def dist_options(
    tensor_parallel: int, hostfile: str | None, rank: int | None, moe_split: str | None = None
) -> DistOptions | None:
    """The parsed options, None when the model runs in this process alone."""
    if tensor_parallel == 1 and hostfile is None and rank is None:
        return None
    from baselm.distributed.launch import DistOptions

    return DistOptions(tensor_parallel=tensor_parallel, hostfile=hostfile, rank=rank, moe_split=moe_split)


def prefix_cache_file(dist: DistOptions | None, path: str | None) -> tuple[DistOptions | None, str | None]:
    """(dist, path): across processes each rank R keeps its own KV heads in `path`.tpR
    (dist/tp_persist.py), so the ranks this process starts are told the path too."""
    if dist is None or path is None:
        return dist, path
    from dataclasses import replace

    return replace(dist, prefix_cache_file=path), path


def serve_pd(*args: object) -> None:
    """`base serve --pd`: `baselm.commands.serve_pd.serve_pd` (returns at once without --pd), imported when called."""
    from baselm.commands.serve_pd import serve_pd as run

    run(*args)


def bench_pd(
    model: str, device: str, pd: str, config: EngineConfig, sizes: tuple, as_json: bool, dist: DistOptions | None
) -> None:
    """`base bench --pd`: `baselm.commands.bench_pd.bench_pd` (imported when called). Its group is
    started on this machine: `dist` (--tensor-parallel, --hostfile, --rank) is refused beside it."""
    from baselm.commands.bench_pd import bench_pd as run
    from baselm.distributed.group import DistError

    if dist is not None:
        raise DistError(
            "base bench --pd starts its own group on this machine: drop --tensor-parallel/--hostfile/--rank"
        )
    run(model, device, pd, config, sizes, as_json)
