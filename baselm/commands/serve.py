"""`base serve`: the HTTP API on one engine, in this process, over a tensor-parallel group, or in
front of a prefill/decode group (--pd, serve_pd.py). The command ends the process itself, with the
server's exit status (see `baselm.api.server.exit_process`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from baselm.api.server import ServeOptions, exit_process, run_server
from baselm.commands.errors import report_user_errors
from baselm.commands.model import ModelArgs, is_follower, open_model, run_follower
from baselm.config import EngineConfig

if TYPE_CHECKING:
    from baselm.commands.serve_pd import PDOptions
    from baselm.distributed.tp.launch import DistOptions


@dataclass(frozen=True, slots=True)
class ServeArgs:
    """What `base serve` does: the model, its engine, how the server listens, and with --pd the
    prefill/decode group it serves from."""

    model: ModelArgs
    engine: EngineConfig
    server: ServeOptions
    pd: PDOptions | None = None  # --pd (and --role): a prefill/decode group; None: one engine


def pd_options(pd: str | None, role: str | None, dist: DistOptions | None) -> PDOptions | None:
    """--pd and --role parsed, with --hostfile/--rank from `dist`; None without --pd (--role is then not read)."""
    if pd is None:
        return None
    from baselm.commands.serve_pd import PDOptions

    return PDOptions.parse(pd, role, dist)


def serve(args: ServeArgs) -> NoReturn:
    """Serves until SIGINT/SIGTERM, then ends the process. A rank other than 0 of a tensor-parallel
    group follows rank 0 instead, and ends the process with it."""
    if args.pd is not None:
        from baselm.commands.serve_pd import serve_pd

        with report_user_errors():
            code = serve_pd(args)
        exit_process(code)  # NOTE: every rank of the group ends here, rank 0 once its server stopped
    with report_user_errors():
        loaded, group = open_model(args.model)
    if is_follower(group):
        raise SystemExit(run_follower(loaded, group, args.model.dist))
    exit_process(run_server(loaded, args.engine, args.server))
