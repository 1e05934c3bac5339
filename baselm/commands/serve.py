"""`base serve`: the HTTP API on one engine, in this process, over a tensor-parallel group, or in
front of a prefill/decode group (--pd, serve_pd.py). The command ends the process itself, with the
server's exit status (see `baselm.api.server.exit_process`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from baselm.api.server import LOG_FORMATS, ServeOptions, exit_process, run_server
from baselm.commands.errors import report_user_errors
from baselm.commands.model import (
    ModelArgs,
    is_follower,
    open_model,
    release_group,
    run_follower,
    warn_without_cpu_kernels,
)
from baselm.commands.options import GenerationOptions
from baselm.config import ConfigError, EngineConfig
from baselm.duration import parse_duration
from baselm.memory import tune_malloc_for_serving

if TYPE_CHECKING:
    from baselm.api.app import PoolSetup
    from baselm.api.pool import PoolLimits
    from baselm.commands.serve_pd import PDOptions
    from baselm.distributed.tp.launch import DistOptions
    from baselm.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class PoolArgs:
    """`base serve` with none or several models: which (none: every model in the store), and when
    they unload (api/pool.py)."""

    refs: tuple[str, ...]
    keep_alive: float | None  # seconds a model stays loaded after its last request; None: for ever
    max_loaded: int = 0  # 0: no limit
    memory_budget: int | None = None  # bytes; None: a safe share of the memory free at start

    def limits(self) -> PoolLimits:
        from baselm.api.pool import PoolLimits
        from baselm.api.server import default_memory_budget

        budget = default_memory_budget() if self.memory_budget is None else self.memory_budget
        return PoolLimits(self.keep_alive, self.max_loaded, budget)


def single_model(models: list[str] | None) -> str:
    """The model `base serve` serves alone (loaded at start, kept), or "" when it serves a pool."""
    return models[0] if models and len(models) == 1 else ""


def model_args(
    models: list[str] | None,
    device: str,
    require_signature: bool,
    dist: DistOptions | None,
    prefix_cache_file: str | None,
    adapters: list[str],
    served_adapters: Sequence[str] = (),
    mmproj: str | None = None,
) -> ModelArgs:
    """The model `base serve` serves alone ("" when it serves a pool), over `dist` (which keeps the
    prefix cache file for the group), with its `--adapter`s merged, its `--lora`s served per request
    and its `--mmproj`: a pool's models are loaded as they are."""
    from baselm.commands.options import with_prefix_cache_file

    if adapters and not (models and len(models) == 1):
        raise ConfigError("--adapter applies to the one model served: base serve MODEL --adapter PATH")
    if served_adapters and not (models and len(models) == 1):
        raise ConfigError("--lora serves adapters of the one model served: base serve MODEL --lora NAME=PATH")
    if mmproj and not (models and len(models) == 1):
        raise ConfigError("--mmproj applies to the one model served: base serve MODEL.gguf --mmproj MMPROJ.gguf")
    dist = with_prefix_cache_file(dist, prefix_cache_file)
    return ModelArgs(
        single_model(models), device, require_signature, dist, tuple(adapters), tuple(served_adapters), mmproj
    )


def pool_args(models: list[str] | None, keep_alive: str, max_loaded: int, memory_budget: int | None) -> PoolArgs | None:
    """The pool `base serve` runs with none or several models named; None with one."""
    if models and len(models) == 1:
        return None
    try:
        seconds = parse_duration(keep_alive)
    except ValueError as exc:
        raise ConfigError(f"--keep-alive: {exc}") from None
    return PoolArgs(tuple(models or ()), None if seconds < 0 else seconds, max_loaded, memory_budget)


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
    pool: PoolArgs | None = None  # none or several models, loaded on demand; None: `model` alone

    def __post_init__(self) -> None:
        if self.server.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {self.server.log_format!r}")
        if self.model.served_adapters and (self.pd is not None or self.model.is_distributed):
            raise ConfigError("--lora serves adapters from one process; it does not run with --pd or --tensor-parallel")
        if self.pool is None:
            return
        if self.pd is not None or self.model.is_distributed:
            raise ConfigError("--pd and --tensor-parallel serve one model; name exactly one")
        if self.server.served_model_name:
            raise ConfigError("--served-model-name names one model; with several, each keeps its own name")

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
    tune_malloc_for_serving()  # before the server's threads: what bursts leave in arenas stays resident
    warn_without_cpu_kernels(args.model.device)
    if args.pd is not None:
        from baselm.commands.serve_pd import serve_pd

        with report_user_errors():
            code = serve_pd(args)
        exit_process(code)  # NOTE: every rank of the group ends here, rank 0 once its server stopped
    if args.pool is not None:
        exit_process(serve_pool(args, args.pool))
    with report_user_errors():
        loaded, group = open_model(args.model)
        check_adapter_names(loaded, args.server.served_model_name or loaded.name)
    if is_follower(group):
        raise SystemExit(run_follower(loaded, group, args.model.dist))
    pool = pulled_models(args) if group is None else None
    code = run_server(loaded, args.engine_config(), args.serve_options(), pool=pool)
    release_group(loaded, group)  # NOTE: exit_process runs no exit handlers
    exit_process(code)


def check_adapter_names(loaded: LoadedModel, model_name: str) -> None:
    """Refuses an adapter (--lora) named as the served model: requests for that name must mean one thing."""
    served = loaded.served_adapters
    if served is not None and served.find(model_name) is not None:
        raise ConfigError(f"--lora {model_name}=...: that is the served model's name; give the adapter another")


def pulled_models(args: ServeArgs) -> PoolSetup:
    """Beside the one model it serves, a server serves what is pulled or copied into the store
    through its API, loaded on demand and unloaded when idle (5 minutes) or to fit free memory."""
    from baselm.api.app import PoolSetup
    from baselm.api.pool import PoolLimits
    from baselm.api.server import default_memory_budget
    from baselm.api.store_models import StoreLoader

    loader = StoreLoader(args.engine_config(), args.model.device, args.model.require_signature, [])
    loader.num_models = 2  # the served model and any pulled one: a prefix-cache file is split
    return PoolSetup(loader, [], PoolLimits(memory_budget=default_memory_budget()))


def serve_pool(args: ServeArgs, pool: PoolArgs) -> int:
    """Serves the pool's models (api/pool.py), each with an engine of `args`' settings; the exit status."""
    from baselm.api.server import run_pool_server
    from baselm.api.store_models import StoreLoader

    with report_user_errors():
        refs = list(pool.refs) or None
        loader = StoreLoader(args.engine_config(), args.model.device, args.model.require_signature, refs)
        loader.num_models = len(refs) if refs else 0
        limits = pool.limits()
        loader.catalog()  # a model named that is not there fails now, not at its first request
    return run_pool_server(loader, args.serve_options(), limits)
