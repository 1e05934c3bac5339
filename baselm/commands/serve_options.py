"""`base serve`'s own options, declared once here, in the panels its `--help` groups them by: the
basics in typer's first panel (Options), then sampling defaults, performance, limits, distributed
and security. The options `serve` shares with other commands come from `options.py`, put in these
panels with `in_panel`. Declarations only: nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from baselm.commands.options import (
    DISTRIBUTED,
    KV_BITS,
    KV_MEMORY_HELP,
    NUM_SPECULATIVE_TOKENS,
    PERFORMANCE,
    SECURITY,
    SPECULATIVE,
    in_panel,
    option_group,
)
from baselm.config import DEFAULT_HOST, DEFAULT_PORT, parse_size

LIMITS = "Limits"

PREFIX_FILE_HELP = (
    "Save the prefix cache here (periodically, at exit) and load it at start "
    "(with --pd: prefill rank R keeps FILE.prefillR; with --tensor-parallel N or --hostfile: rank R keeps "
    "its KV heads in FILE.tpR, on its own machine)."
)
PREFIX_SAVE_HELP = "Seconds between saves of a changed prefix cache."
PREFIX_MAX_HELP = "Most K/V the prefix cache file holds (per rank of a group), e.g. 1GiB (default: the pool)."
MAX_CONNECTIONS_HELP = "Connections open at once, idle ones included; past it a request gets 503."
LOG_FORMAT_HELP = "The log's lines: text, or json (one object a line); a line per request either way."
READ_TIMEOUT_HELP = "Seconds a request's headers, and then its body, may take to arrive (408 past it)."
SHUTDOWN_HELP = "Seconds in-flight requests get to finish on SIGINT/SIGTERM."
CORS_HELP = (
    "Web origins allowed to call from a browser, comma-separated ('*': any; 'localhost': this machine's "
    "pages; default none)."
)
ALLOWED_HOSTS_HELP = (
    "Host names answered beside the bound address and localhost, comma-separated ('*': any); others get a 403 "
    "(DNS rebinding). Default: loopback's names when bound to loopback, any name otherwise."
)
PD_HELP = "Prefill/decode disaggregation: P prefill and D decode processes, e.g. 1:1 (see docs/distributed.md)."
ROLE_HELP = "With --pd over machines: this rank's role, prefill or decode (checked against --rank)."
API_KEY_HELP = "Require 'Authorization: Bearer KEY' (env BASE_API_KEY)."
API_KEY_FILE_HELP = "Read the key from this file (its one line), out of sight of ps; instead of --api-key."

# Options (the basics; --device is options.py's)
HOST = typer.Option(DEFAULT_HOST, "--host", help="Address to listen on (0.0.0.0: every interface).")
PORT = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on.")
SERVED_MODEL_NAME = typer.Option(None, "--served-model-name", help="Model name clients send (one model served).")
LORA = typer.Option(
    [],
    "--lora",
    help=(
        "A LoRA adapter served beside the plain model, NAME=PATH[:scale] (an mlx-lm or PEFT folder or a GGUF LoRA); "
        "a request whose model is NAME runs with it, batched with the others; repeatable (one model served)."
    ),
    show_default=False,
)
SERVE_MODELS_HELP = (
    "Models to serve: store names (org/name[:variant] or an alias), .base or .gguf files, or HF folders. "
    "None: every model in the store, each loaded on its first request."
)
SERVE_MODELS = typer.Argument(None, help=SERVE_MODELS_HELP, show_default=False)
WEBUI = typer.Option(True, "--webui/--no-webui", help="Serve the chat page at / to browsers.")

# Sampling defaults: options.py's generation options, in their own panel
# Performance
KV_MEMORY = typer.Option(None, "--kv-memory", help=KV_MEMORY_HELP, rich_help_panel=PERFORMANCE)
SERVE_KV_BITS = in_panel(KV_BITS, PERFORMANCE)
MAX_NUM_SEQS = typer.Option(16, "--max-num-seqs", help="Requests running at once.", rich_help_panel=PERFORMANCE)
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="Context length cap.", rich_help_panel=PERFORMANCE)
MAX_NUM_BATCHED_TOKENS = typer.Option(
    1024, "--max-num-batched-tokens", help="Tokens per engine step.", rich_help_panel=PERFORMANCE
)
NO_PREFIX_CACHING = typer.Option(
    False, "--no-prefix-caching", help="Turn prefix caching off.", rich_help_panel=PERFORMANCE
)
PREFIX_CACHE_FILE = typer.Option(None, "--prefix-cache-file", help=PREFIX_FILE_HELP, rich_help_panel=PERFORMANCE)
PREFIX_CACHE_SAVE_INTERVAL = typer.Option(
    300.0, "--prefix-cache-save-interval", help=PREFIX_SAVE_HELP, rich_help_panel=PERFORMANCE
)
PREFIX_CACHE_MAX_SIZE = typer.Option(None, "--prefix-cache-max-size", help=PREFIX_MAX_HELP, rich_help_panel=PERFORMANCE)
SERVE_SPECULATIVE = in_panel(SPECULATIVE, PERFORMANCE)
SERVE_NUM_SPECULATIVE_TOKENS = in_panel(NUM_SPECULATIVE_TOKENS, PERFORMANCE)

# Limits
MAX_WAITING = typer.Option(256, "--max-waiting", help="Queued requests beyond this get 429.", rich_help_panel=LIMITS)
MAX_BODY = typer.Option(
    "8MiB", "--max-body", help="Largest request body accepted (413 past it).", rich_help_panel=LIMITS
)
ALLOW_IMAGE_URLS = typer.Option(
    False,
    "--allow-image-urls",
    help="Fetch http(s) image URLs in requests (within 20 MiB and 10 s each); otherwise images come as data URLs.",
    rich_help_panel=LIMITS,
)
MAX_CONNECTIONS = typer.Option(512, "--max-connections", min=1, help=MAX_CONNECTIONS_HELP, rich_help_panel=LIMITS)
READ_TIMEOUT = typer.Option(30.0, "--read-timeout", min=0.1, help=READ_TIMEOUT_HELP, rich_help_panel=LIMITS)
SHUTDOWN_TIMEOUT = typer.Option(30.0, "--shutdown-timeout", help=SHUTDOWN_HELP, rich_help_panel=LIMITS)

KEEP_ALIVE_HELP = (
    "With several models: how long one stays loaded after its last request, e.g. 5m, 1h30m, 0 (at once), "
    "-1 (for ever); a request's keep_alive overrides it."
)
MAX_LOADED_HELP = "With several models: most loaded at once (0: no limit); the least recently used idle one unloads."
MEMORY_BUDGET_HELP = (
    "With several models: memory the loaded ones may hold, e.g. 8GiB; the least recently used idle one unloads "
    "to make room (default: 3/4 of the memory free at start; 0: no limit)."
)
KEEP_ALIVE = typer.Option("5m", "--keep-alive", help=KEEP_ALIVE_HELP, rich_help_panel=LIMITS)
MAX_LOADED_MODELS = typer.Option(0, "--max-loaded-models", min=0, help=MAX_LOADED_HELP, rich_help_panel=LIMITS)
MEMORY_BUDGET = typer.Option(None, "--memory-budget", help=MEMORY_BUDGET_HELP, rich_help_panel=LIMITS)

# Distributed (--tensor-parallel, --hostfile, --rank and --moe-split are options.py's, in this panel already)
PD = typer.Option(None, "--pd", help=PD_HELP, rich_help_panel=DISTRIBUTED)
ROLE = typer.Option(None, "--role", help=ROLE_HELP, rich_help_panel=DISTRIBUTED)

# Security (--require-signature is options.py's, in this panel already)
API_KEY = typer.Option(None, "--api-key", envvar="BASE_API_KEY", help=API_KEY_HELP, rich_help_panel=SECURITY)
API_KEY_FILE = typer.Option(None, "--api-key-file", help=API_KEY_FILE_HELP, rich_help_panel=SECURITY)
ALLOWED_HOSTS = typer.Option("", "--allowed-hosts", help=ALLOWED_HOSTS_HELP, rich_help_panel=SECURITY)
CORS_ORIGINS = typer.Option("", "--cors-origins", help=CORS_HELP, rich_help_panel=SECURITY)
LOG_FORMAT = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may hold of the server (a body's size, open connections, time to send a
    request, what a request in flight gets at shutdown, whether it may have image URLs fetched),
    and how the server logs each request: serve's options, parsed."""

    max_body_bytes: int
    allow_image_urls: bool
    max_connections: int
    read_timeout: float
    shutdown_timeout: float
    log_format: str

    @classmethod
    def parse(cls, max_body: str, **values: Any) -> ServerLimits:
        return cls(max_body_bytes=parse_size(max_body), **values)

    def apply(self, server: Any) -> None:
        """Sets these on `server` (a ServeOptions)."""
        for field in self.__slots__:
            setattr(server, field, getattr(self, field))


_LIMIT_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("max_body", str, MAX_BODY),
    ("allow_image_urls", bool, ALLOW_IMAGE_URLS),
    ("max_connections", int, MAX_CONNECTIONS),
    ("read_timeout", float, READ_TIMEOUT),
    ("shutdown_timeout", float, SHUTDOWN_TIMEOUT),
    ("log_format", str, LOG_FORMAT),
)
server_limit_options = option_group("limits", _LIMIT_OPTIONS, ServerLimits.parse)
