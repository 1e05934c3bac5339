"""`base serve`: the HTTP API on one engine, in this process, over a tensor-parallel group, or in
front of a prefill/decode group (--pd, serve_pd.py). The command ends the process itself, with the
server's exit status (see `baselm.api.server.exit_process`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from baselm.api.server import LOG_FORMATS, ServeOptions, exit_process, run_server
from baselm.commands.errors import report_user_errors
from baselm.commands.model import ModelArgs, is_follower, open_model, run_follower, warn_without_cpu_kernels
from baselm.commands.options import GenerationOptions
from baselm.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from baselm.commands.serve_pd import PDOptions
    from baselm.distributed.tp.launch import DistOptions


@dataclass(frozen=True, slots=True)
class ServeArgs:
    """What `base serve` does: the model, its engine, how the server listens, the generation options
    (applied to both by `engine_config` and `serve_options`), and with --pd the prefill/decode group
    it serves from."""

    model: ModelArgs
    engine: EngineConfig
    server: ServeOptions
    generation: GenerationOptions
    pd: PDOptions | None = None  # --pd (and --role): a prefill/decode group; None: one engine

    def __post_init__(self) -> None:
        if self.server.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {self.server.log_format!r}")

    def engine_config(self) -> EngineConfig:
        """The engine's settings with the seed of requests that bring none and the runaway guard."""
        return replace(self.engine, seed=self.generation.seed, runaway_guard=self.generation.runaway_guard)

    def serve_options(self) -> ServeOptions:
        """How the server answers, with the defaults of what requests leave out."""
        return replace(self.server, sampling=self.generation.sampling)


def read_api_key_file(path: str) -> str:
    """The key `--api-key-file` names: the file's one line, less its trailing newline, so the key
    stays out of `ps` and shell history. A missing, empty or many-line file is a ConfigError."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--api-key-file {path}: no such file; write the key into it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path} cannot be read as text ({exc})") from None
    key = text.removesuffix("\n").removesuffix("\r")
    if not key.strip():
        raise ConfigError(f"--api-key-file {path} is empty; write the key into it")
    if "\n" in key or "\r" in key:
        raise ConfigError(f"--api-key-file {path} holds several lines; the key is one line")
    return key


def api_key_option(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key (or BASE_API_KEY) or --api-key-file; giving both is a ConfigError."""
    if api_key_file is None:
        return api_key or None
    if api_key:
        raise ConfigError("give the API key one way: --api-key-file, or --api-key / BASE_API_KEY, not both")
    return read_api_key_file(api_key_file)


def pd_options(pd: str | None, role: str | None, dist: DistOptions | None) -> PDOptions | None:
    """--pd and --role parsed, with --hostfile/--rank from `dist`; None without --pd (--role is then not read)."""
    if pd is None:
        return None
    from baselm.commands.serve_pd import PDOptions

    return PDOptions.parse(pd, role, dist)


def serve(args: ServeArgs) -> NoReturn:
    """Serves until SIGINT/SIGTERM, then ends the process. A rank other than 0 of a tensor-parallel
    group follows rank 0 instead, and ends the process with it."""
    warn_without_cpu_kernels(args.model.device)
    if args.pd is not None:
        from baselm.commands.serve_pd import serve_pd

        with report_user_errors():
            code = serve_pd(args)
        exit_process(code)  # NOTE: every rank of the group ends here, rank 0 once its server stopped
    with report_user_errors():
        loaded, group = open_model(args.model)
    if is_follower(group):
        raise SystemExit(run_follower(loaded, group, args.model.dist))
    exit_process(run_server(loaded, args.engine_config(), args.serve_options()))
