"""`base serve`: load a model, start the engine thread, run the app under uvicorn until a signal.

SIGINT or SIGTERM: stop accepting connections, let in-flight requests finish for up to
`shutdown_timeout` seconds (then they are cancelled, which aborts them), stop the engine,
exit 0. A second SIGINT quits at once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import uvicorn

from baselm.api import request_log
from baselm.api.app import PoolSetup, create_app
from baselm.api.connections import DEFAULT_READ_TIMEOUT, DeadlineProtocol
from baselm.api.guard import is_loopback
from baselm.api.pool import ModelLoader, PoolLimits
from baselm.api.request_log import JSONFormatter
from baselm.api.state import DEFAULT_MAX_BODY_BYTES
from baselm.async_engine import AsyncEngine
from baselm.config import DEFAULT_HOST, DEFAULT_PORT, EngineConfig
from baselm.duration import describe_duration
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.sampling.defaults import NO_DEFAULTS, GenerationDefaults, SamplingDefaults

logger = logging.getLogger("baselm.api")

DEFAULT_MAX_CONNECTIONS = 512  # each open connection holds a socket and its buffers, idle or not


LOG_FORMATS = ("text", "json")


@dataclass(slots=True)
class ServeOptions:
    """How `base serve` listens and answers: address, key, body limit, shutdown grace, log level, CORS, Host
    names, connections open at once, the log's format, and the command line's generation defaults."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    cors_origins: tuple[str, ...] = ()  # web origins allowed to call from a browser; none by default
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beside the bound address and loopback's ("*": any)
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once; past it uvicorn answers 503
    read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds for a request's headers, and again for its body
    log_format: str = "text"  # or "json": one object a line (request_log.py)
    sampling: SamplingDefaults = NO_DEFAULTS  # --temperature, --top-p, ...: for what requests leave out
    webui: bool = True  # the chat page at / (--no-webui: off)
    allow_image_urls: bool = False  # fetch http(s) image URLs in requests (--allow-image-urls)


class Server(uvicorn.Server):
    """uvicorn's server with signal handling that ends in a clean exit (uvicorn re-raises the signal)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(
    client: AsyncEngine | None, model_name: str, options: ServeOptions, pool: PoolSetup | None = None
) -> Server:
    """The server of `client`'s model (pinned) and of `pool`'s models (loaded on demand)."""
    app = create_app(
        client,
        model_name,
        pool=pool,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        read_timeout=options.read_timeout,
        cors_origins=options.cors_origins,
        host=options.host,
        allowed_hosts=options.allowed_hosts,
        sampling_defaults=options.sampling,
        webui=options.webui,
        allow_image_urls=options.allow_image_urls,
    )
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_config=log_config(options.log_level, options.log_format),
        log_level=options.log_level,
        timeout_graceful_shutdown=options.shutdown_timeout,
        lifespan="off",
        access_log=options.log_level == "debug",
        limit_concurrency=options.max_connections + 1,  # uvicorn counts the connection asking among those open
        http=functools.partial(DeadlineProtocol, read_timeout=options.read_timeout),
    )
    return Server(config)


def log_config(level: str, log_format: str) -> dict[str, Any]:
    """The server's logging (`logging.config.dictConfig`, which uvicorn applies): uvicorn's own, and
    the `baselm` loggers (a line per request among them) through one more handler at `level`;
    `log_format` json writes every line as one JSON object.

    NOTE: the level is the handler's, not the `baselm` logger's, so that a server started in a
    process (a test's) leaves its loggers' levels alone; the request logger itself is at info."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    if log_format == "json":
        config["formatters"] = {name: {"()": JSONFormatter} for name in config["formatters"]}
    config["handlers"]["base"] = {
        "formatter": "default",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "level": level.upper(),
    }
    config["loggers"]["baselm"] = {"handlers": ["base"]}
    config["loggers"][request_log.logger.name] = {"level": "INFO"}
    return config


def banner(
    model_name: str,
    options: ServeOptions,
    generation: GenerationDefaults,
    runaway_guard: int,
    adapter_names: Sequence[str] = (),
) -> str:
    """What `base serve` prints at start: the URL, the LoRA adapters served as models of their own, a
    request to paste, and what a request that leaves sampling or its length out gets."""
    url = _url(options)
    guard = "no runaway guard (--runaway-guard 0)"
    if runaway_guard:
        guard = f"an answer that repeats one n-gram for {runaway_guard} tokens is cut (--runaway-guard)"
    adapters = ""
    if adapter_names:
        adapters = f"LoRA adapters of {model_name}, each a model name of its own: {', '.join(adapter_names)}\n"
    return (
        f"Serving {model_name} at {url}/v1 (OpenAI-compatible)\n{adapters}"
        f"Requests that leave them out get {generation.describe()}; {guard}.\n"
        f"Try:\n{_curl(url, model_name, options)}"
    )


def _url(options: ServeOptions) -> str:
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(
        options.host, options.host
    )  # a wildcard: any local address
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{options.port}"


def _curl(url: str, model_name: str, options: ServeOptions) -> str:
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = ' -H "Authorization: Bearer $BASE_API_KEY"' if options.api_key else ""
    return f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d '{body}'\n"


def warn_without_key(options: ServeOptions) -> None:
    if not options.api_key and not is_loopback(options.host):
        print(
            f"WARNING: serving on {options.host} without an API key: anyone who can reach this port can use the "
            "model. Set --api-key or BASE_API_KEY.",
            file=sys.stderr,
        )


MEMORY_SHARE = 0.75  # of the memory free at start, the loaded models' default budget


def default_memory_budget() -> int:
    """A safe share of the memory free now (0: unknown, no budget)."""
    from baselm.backend import available_memory_bytes

    return int((available_memory_bytes() or 0) * MEMORY_SHARE)


def run_pool_server(loader: ModelLoader, options: ServeOptions, limits: PoolLimits) -> int:
    """Serves the models of `loader`'s catalog, each loaded on its first request and unloaded by
    `limits`, until SIGINT/SIGTERM; returns the exit status."""
    warn_without_key(options)
    servables = loader.catalog()
    server = make_server(None, "", options, PoolSetup(loader, servables, limits))
    print(pool_banner([s.name for s in servables], options, limits), flush=True)
    return serve_until_stopped(server)


def pool_banner(names: list[str], options: ServeOptions, limits: PoolLimits) -> str:
    """What `base serve` with several models prints at start: the URL, the models, when they load and unload."""
    url = _url(options)
    listed = ", ".join(names) if names else "none yet (`base pull` or POST /api/pull adds one, servable at once)"
    most = f"at most {limits.max_loaded} loaded" if limits.max_loaded else "any number loaded"
    budget = f"within {limits.memory_budget / 2**30:.1f} GiB" if limits.memory_budget else "with no memory budget"
    text = (
        f"Serving {len(names)} models at {url}/v1 (OpenAI-compatible) and {url}/api (Ollama): {listed}\n"
        f"Each loads on its first request and unloads {describe_duration(limits.keep_alive)} after its last "
        f"(--keep-alive); {most} (--max-loaded-models), {budget} (--memory-budget).\n"
    )
    if names:
        text += f"Try:\n{_curl(url, names[0], options)}"
    return text


def run_server(
    loaded: LoadedModel, config: EngineConfig, options: ServeOptions, engine=None, pool: PoolSetup | None = None
) -> int:
    """Serves `loaded` until SIGINT/SIGTERM; returns the exit status. `engine`: one already built
    (a prefill/decode group's PDEngine); by default an LLMEngine of `loaded` and `config`. `pool`:
    the models served beside it, loaded on demand (those pulled or copied through the API)."""
    warn_without_key(options)
    engine = engine if engine is not None else LLMEngine(loaded, config)
    client = AsyncEngine(engine).start()
    model_name = options.served_model_name or loaded.name
    server = make_server(client, model_name, options, pool)
    generation = server.config.app.state.pool.entries[model_name].state.generation  # what its requests get
    adapters = loaded.served_adapters.names if loaded.served_adapters is not None else []
    print(banner(model_name, options, generation, engine.config.runaway_guard, adapters), flush=True)
    return serve_until_stopped(server)


def serve_until_stopped(server: Server) -> int:
    """Runs `server` until a signal, then stops every model's engine; returns the exit status."""
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits when it cannot bind the port (it has logged why)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        server.config.app.state.pool.stop(lambda state: state.client.stop())
    return 0 if server.started else 1


def exit_process(code: int) -> NoReturn:
    """Ends the process now, output flushed.

    NOTE: after MLX has run on a thread other than the main one (the engine's), the
    interpreter's own exit can abort in MLX's teardown (std::terminate, SIGABRT), which would
    turn a clean shutdown into a crash. Everything is stopped by now, so that teardown is skipped.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
