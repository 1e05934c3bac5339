"""`base chat`: the REPL on one engine; with --serve, the HTTP API on the same engine beside it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from baselm.async_engine import AsyncEngine
from baselm.chat.line_reader import history_path, last_chat_path
from baselm.chat.repl import ChatREPL
from baselm.chat.settings import ChatOptions
from baselm.chat.switch import ModelSwitch, Opened
from baselm.commands.model import (
    ModelArgs,
    is_follower,
    load_alone,
    open_model,
    run_follower,
    warn_without_cpu_kernels,
)
from baselm.commands.options import GenerationOptions

if TYPE_CHECKING:
    from baselm.api.server import ServeOptions  # the HTTP server is imported only with --serve


class ServeError(RuntimeError):
    """The HTTP server of `base chat --serve` could not start; the message says why."""


@dataclass(frozen=True, slots=True)
class ChatArgs:
    """What `base chat` does: the model, the chat it starts with, the generation options (the first
    settings' defaults and seed, the runaway guard; with --serve also the served requests' defaults),
    and with --serve how it serves."""

    model: ModelArgs
    chat: ChatOptions
    generation: GenerationOptions
    serve: ServeOptions | None = None  # --serve: the HTTP API on the chat's engine


def chat_serve_options(host: str, port: int) -> ServeOptions:
    """How `base chat --serve` serves: quietly, with the API key from $BASE_API_KEY."""
    from baselm.api.guard import is_loopback
    from baselm.api.server import ServeOptions

    api_key = os.environ.get("BASE_API_KEY") or None
    if not api_key and not is_loopback(host):
        print(f"WARNING: serving on {host} without an API key; set BASE_API_KEY.", file=sys.stderr)
    return ServeOptions(host=host, port=port, api_key=api_key, log_level="warning")


def chat(args: ChatArgs) -> None:
    """Loads the model and runs the REPL on its engine, the HTTP API beside it with `args.serve`. A
    rank other than 0 of a tensor-parallel group follows rank 0 instead, and ends the process with it."""
    from rich.console import Console

    warn_without_cpu_kernels(args.model.device)
    with Console(stderr=True).status(f"loading {args.model.ref}"):
        loaded, group = open_model(args.model)
    if is_follower(group):
        raise SystemExit(run_follower(loaded, group, args.model.dist))
    loaded.check_writes_text()
    generation = args.generation
    config = replace(args.chat.engine, runaway_guard=generation.runaway_guard)
    engines = ModelSwitch(
        lambda ref: load_alone(
            replace(args.model, ref=ref, adapters=())
        ),  # an adapter is for the model it was made for
        config,
        generation.sampling,
        generation.seed,
    )
    with contextlib.closing(engines):
        repl = _repl(args, engines.open(loaded, args.model.ref), engines)
        del loaded  # the switch holds the model now, and /model lets it go
        serve = replace(args.serve, sampling=generation.sampling) if args.serve else None
        with background_server(repl.client, repl.model_name, serve) if serve else contextlib.nullcontext() as url:
            if args.chat.resume:
                repl.resume()
            if url is not None:
                repl.note(f"serving the OpenAI API at {url} on this chat's engine")
            repl.run()


def _repl(args: ChatArgs, opened: Opened, engines: ModelSwitch) -> ChatREPL:
    """The REPL on the engine just opened. It may switch models unless that engine also serves
    HTTP (--serve) or leads a tensor-parallel group (--dist): those stay on the model they started with."""
    switch = None if args.serve or args.model.is_distributed else engines
    model_name = opened.client.engine.loaded.name
    chat = args.chat
    return ChatREPL(opened.client, model_name, opened.settings, chat.system, history_path(), last_chat_path(), switch)


@contextlib.contextmanager
def background_server(client: AsyncEngine, model_name: str, options: ServeOptions) -> Iterator[str]:
    """The HTTP API on `client`'s engine, under uvicorn on a thread of its own, while the block runs;
    yields its URL."""
    from baselm.api.server import make_server

    server = make_server(client, model_name, options)
    thread = threading.Thread(target=server.run, name="base-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise ServeError(f"could not serve on {options.host}:{options.port}; is the port in use?")
        host = f"[{options.host}]" if ":" in options.host else options.host
        yield f"http://{host}:{options.port}/v1"
    finally:
        server.should_exit = True
        thread.join(5.0)
