"""The `base` command line: Typer options parsed into typed options, handed to the commands' modules.

Heavy modules (MLX, the engine, rich, the HTTP server) are imported inside the commands, so `--help` is instant."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer

from baselm.commands import distributed as cli_dist
from baselm.commands import perplexity as perplexity_command
from baselm.commands import signing as signing_commands
from baselm.commands import store as store_commands
from baselm.commands.distributed import (
    HOSTFILE,
    RANK,
    TENSOR_PARALLEL,
    bench_pd,
    dist_options,
    prefix_cache_file,
    serve_pd,
)
from baselm.commands.errors import DEVICE_HELP, MODEL_HELP
from baselm.commands.errors import fail as _fail
from baselm.commands.errors import user_errors as _user_errors
from baselm.config import (
    EngineConfig,
    SpeculativeConfig,
    format_size,
    parse_int_list,
    parse_optional_size,
    parse_size,
    parse_size_list,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from baselm.api.server import ServeOptions
    from baselm.async_engine import AsyncEngine
    from baselm.chat.settings import ChatOptions
    from baselm.store.registry import StoredModel

app = typer.Typer(
    name="base",
    help="base: run LLMs locally on MLX. Chat in the terminal or serve the OpenAI API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PREFIX_FILE_HELP = (
    "Save the prefix cache here (periodically, at exit) and load it at start "
    "(with --pd: prefill rank R keeps FILE.prefillR; with --tensor-parallel N or --hostfile: rank R keeps "
    "its KV heads in FILE.tpR, on its own machine)."
)
PREFIX_SAVE_HELP = "Seconds between saves of a changed prefix cache."
PREFIX_MAX_HELP = "Most K/V the prefix cache file holds (per rank of a group), e.g. 1GiB (default: the pool)."
SHUTDOWN_HELP = "Seconds in-flight requests get to finish on SIGINT/SIGTERM."
CORS_HELP = (
    "Web origins allowed to call from a browser, comma-separated ('*': any; 'localhost': this machine's "
    "pages; default none)."
)
SPEC_HELP = "Speculative decoding: ngram (prompt lookup) or a draft model with the same tokenizer."
SPEC_K_HELP = "Most speculative tokens a request verifies per step (with --speculative)."
SPEC_FIXED_HELP = "Always verify --num-speculative-tokens drafts (no adaptive rule)."
PD_HELP = "Prefill/decode disaggregation: P prefill and D decode processes, e.g. 1:1 (see README)."
ROLE_HELP = "With --pd over machines: this rank's role, prefill or decode (checked against --rank)."
WORKLOAD_HELP = "With --speculative: grounded (answers copy the prompt), free, random; comma-separated."


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the models in the local store."""
    from baselm.store.registry import Store, model_entry

    models = Store().list()
    if as_json:
        print(json.dumps([model_entry(m) for m in models], indent=2))
        return
    from rich.console import Console

    if not models:
        Console().print("No models yet. Try: base pull HuggingFaceTB/SmolLM2-135M-Instruct")
        return
    console = Console()
    if not console.is_terminal:  # into a pipe: as wide as it needs (rich would assume 80 columns)
        console = Console(width=1000)
    console.print(_models_table(models, console))


def _models_table(models: list[StoredModel], console: Console) -> Table:
    """The `base list` table. A name is what you type next, so it is never cut: when the terminal
    is narrow, the source, the pull time, then arch and quant are left out (the rest may be shortened)."""
    from rich.measure import Measurement
    from rich.table import Table

    rows = []
    for m in models:
        origin = m.source.get("repo") or m.source.get("path") or m.source.get("format", "")
        size = format_size(m.size, "MiB", 0)
        rows.append([m.name, m.variant, m.arch, f"{m.params / 1e6:.0f}M", size, m.quant, str(origin), m.pulled[:19]])
    names = ["name", "variant", "arch", "params", "size", "quant", "source", "pulled"]
    for shown in (names, names[:6] + names[7:], names[:6], ["name", "variant", "params", "size"]):
        table = Table()
        for name in shown:
            table.add_column(
                name, no_wrap=name == "name", min_width=max(len(r[0]) for r in rows) if name == "name" else None
            )
        for row in rows:
            table.add_row(*(value for name, value in zip(names, row) if name in shown))
        if Measurement.get(console, console.options.update_width(10**4), table).maximum <= console.width:
            break
    return table


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    links: bool = typer.Option(False, "--links", help="Also time a 2-process ring all_sum over loopback."),
) -> None:
    """Check this machine: Python, MLX, backend, memory, BLAS, store location, distributed backends."""
    from baselm.commands.doctor import collect, render

    report = collect(links)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report)


REQUIRE_SIGNATURE_HELP = "Refuse a model without a good signature by a trusted key (see base verify)."


@app.command()
def run(
    model: str = typer.Argument(..., help=MODEL_HELP),
    prompt: str = typer.Argument(..., help="The prompt. Use - to read it from standard input."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the K most likely tokens (0: off)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, not through the chat template."),
    logprobs: int | None = typer.Option(
        None, "--logprobs", help="Return log-probabilities with the top K alternatives."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    require_signature: bool = typer.Option(False, "--require-signature", help=REQUIRE_SIGNATURE_HELP),
    speculative: str | None = typer.Option(None, "--speculative", help=SPEC_HELP),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help=SPEC_K_HELP),
    fixed_speculation: bool = typer.Option(False, "--fixed-speculation", help=SPEC_FIXED_HELP),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = cli_dist.MOE_SPLIT,
) -> None:
    """Generate once from a prompt and print the answer with its speed."""
    from baselm.commands.run import RunOptions, run_once
    from baselm.sampling.params import SamplingParams

    try:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs
        )
        prompt = sys.stdin.read() if prompt == "-" else prompt
        spec = SpeculativeConfig.parse(speculative, num_speculative_tokens, adaptive=not fixed_speculation)
        run_once(
            RunOptions(
                model,
                prompt,
                sampling,
                raw=raw,
                as_json=as_json,
                device=device,
                require_signature=require_signature,
                speculative=spec,
                dist=dist_options(tensor_parallel, hostfile, rank, moe_split),
            )
        )
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def chat(
    model: str = typer.Argument(..., help=MODEL_HELP),
    system: str | None = typer.Option(None, "--system", help="System prompt for the conversation."),
    temperature: float = typer.Option(0.7, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling threshold."),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", "-n", help="Most tokens per answer (default: the context's room)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    kv_memory: str | None = typer.Option(None, "--kv-memory", help="Memory for the KV cache, e.g. 2GiB."),
    serve: bool = typer.Option(False, "--serve", help="Also serve the HTTP API on the same engine."),
    port: int = typer.Option(8080, "--port", help="Port for --serve."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address for --serve."),
    require_signature: bool = typer.Option(False, "--require-signature", help=REQUIRE_SIGNATURE_HELP),
    resume: bool = typer.Option(False, "--resume", help="Reopen the last conversation (its prompt comes cached)."),
    prefix_cache_file_choice: str = typer.Option(
        "auto", "--prefix-cache-file", help="Keep the prefix cache here across runs (auto: per model; none: off)."
    ),
    prefix_cache_max_size: str | None = typer.Option(
        None, "--prefix-cache-max-size", help="Most K/V the prefix cache file holds, e.g. 1GiB (default: the pool)."
    ),
    speculative: str | None = typer.Option(None, "--speculative", help=SPEC_HELP),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help=SPEC_K_HELP),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = cli_dist.MOE_SPLIT,
) -> None:
    """Chat with a model in the terminal (/help inside for commands)."""
    from baselm.chat.settings import ChatOptions, ChatSettings, chat_prefix_cache_file

    try:
        dist = dist_options(tensor_parallel, hostfile, rank, moe_split)
        dist, prefix_file = prefix_cache_file(dist, chat_prefix_cache_file(prefix_cache_file_choice, model))
        options = ChatOptions(
            model,
            ChatSettings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed),
            EngineConfig(
                kv_memory=parse_optional_size(kv_memory),
                prefix_cache_file=prefix_file,
                prefix_cache_max_size=parse_optional_size(prefix_cache_max_size),
                speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens),
            ),
            system=system,
            device=device,
            require_signature=require_signature,
            resume=resume,
            dist=dist,
        )
        _chat(options, _chat_serve_options(host, port) if serve else None)
    except _user_errors() + (ServeError,) as exc:
        _fail(str(exc))


def _chat(options: ChatOptions, serve: ServeOptions | None) -> None:
    """The REPL on its engine; with `serve`, the HTTP API on the same engine beside it."""
    from baselm.chat.line_reader import history_path, last_chat_path
    from baselm.chat.repl import ChatREPL, open_chat_engine

    with open_chat_engine(options) as client:
        model_name = client.engine.loaded.name
        with _background_server(client, model_name, serve) if serve else contextlib.nullcontext() as url:
            repl = ChatREPL(client, model_name, options.settings, options.system, history_path(), last_chat_path())
            if options.resume:
                repl.resume()
            if url is not None:
                repl.note(f"serving the OpenAI API at {url} on this chat's engine")
            repl.run()


class ServeError(RuntimeError):
    """The HTTP server of `base chat --serve` could not start; the message says why."""


def _chat_serve_options(host: str, port: int) -> ServeOptions:
    """How `base chat --serve` serves: quietly, with the API key from $BASE_API_KEY."""
    from baselm.api.server import ServeOptions, is_loopback

    api_key = os.environ.get("BASE_API_KEY") or None
    if not api_key and not is_loopback(host):
        print(f"WARNING: serving on {host} without an API key; set BASE_API_KEY.", file=sys.stderr)
    return ServeOptions(host=host, port=port, api_key=api_key, log_level="warning")


@contextlib.contextmanager
def _background_server(client: AsyncEngine, model_name: str, options: ServeOptions) -> Iterator[str]:
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


SYNTHETIC_HELP = (
    "Instead of a model: random-weight models of these sizes (135M,360M,1B), decode tok/s beside the roofline."
)


CPU_LAYER_HELP = "Also decode one stream with the CPU decoder-layer kernel on and off."


@app.command()
def bench(
    model: str | None = typer.Argument(None, help=MODEL_HELP + " Not with --synthetic."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Prompt length of each request."),
    gen_tokens: int = typer.Option(64, "--gen-tokens", help="Tokens generated per request."),
    concurrency: str = typer.Option("1,4,8", "--concurrency", help="Comma-separated concurrent request counts."),
    shared_prefix: int = typer.Option(0, "--shared-prefix", help="Also time prompts sharing their first N tokens."),
    long_prompt: int = typer.Option(0, "--long-prompt", help="Also prefill an N-token prompt while 4 streams decode."),
    chunk: int = typer.Option(64, "--chunk", help="Token budget per step in the --long-prompt scenario."),
    pool_sizes: str = typer.Option("", "--pool-sizes", help="Also compare decode steps for KV pools: 256MiB,4GiB."),
    compare_mlx_lm: bool = typer.Option(False, "--compare-mlx-lm", help="Also run mlx-lm's decode loop."),
    compare_cpu_layer: bool = typer.Option(False, "--compare-cpu-layer", help=CPU_LAYER_HELP),
    kv_memory: str | None = typer.Option(None, "--kv-memory", help="KV pool size, e.g. 1GiB (default: from memory)."),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(1024, "--max-num-batched-tokens", help="Token budget per step."),
    seed: int = typer.Option(0, "--seed", help="Seed for the random prompts."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    speculative: str | None = typer.Option(None, "--speculative", help=SPEC_HELP),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help=SPEC_K_HELP),
    fixed_speculation: bool = typer.Option(False, "--fixed-speculation", help=SPEC_FIXED_HELP),
    workload: str = typer.Option("grounded,free", "--workload", help=WORKLOAD_HELP),
    spec_repeats: int = typer.Option(2, "--spec-repeats", help="Speculative: alternating runs of each, best kept."),
    synthetic: str = typer.Option("", "--synthetic", help=SYNTHETIC_HELP),
    synthetic_bits: int = typer.Option(4, "--synthetic-bits", help="4 or 8 (affine, groups of 32), 32: float32."),
    pd: str | None = typer.Option(None, "--pd", help="Also run the batch (the last --concurrency) on a P:D group."),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = cli_dist.MOE_SPLIT,
) -> None:
    """Measure prefill and decode speed, latency and memory of the engine on a model (with
    --speculative, also each workload with and without speculative decoding, side by side)."""
    from baselm.commands.bench import render, run_all
    from baselm.distributed.launch import describe, load_model_for

    if synthetic or model is None:
        _bench_synthetic(model, synthetic, synthetic_bits, gen_tokens, seed, device, as_json)
        return
    try:
        size, dist = parse_optional_size(kv_memory), dist_options(tensor_parallel, hostfile, rank, moe_split)
        config = EngineConfig(kv_memory=size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        if pd is not None:  # one process, then a prefill/decode group, on the same batch
            return bench_pd(model, device, pd, config, (prompt_tokens, gen_tokens, concurrency, seed), as_json, dist)
        options = _bench_options(locals())
        loaded = load_model_for(model, device, False, dist)
        report = {**run_all(loaded, config, options), "distributed": describe(loaded)}
    except _user_errors() as exc:
        _fail(str(exc))
    _print_bench(report, as_json, render)


def _bench_options(o: dict):
    """`bench`'s parameters (its `locals()`) as the engine benchmark's options."""
    from baselm.commands.bench import BenchOptions

    speculative = SpeculativeConfig.parse(
        o["speculative"], o["num_speculative_tokens"], adaptive=not o["fixed_speculation"]
    )
    return BenchOptions(
        prompt_tokens=o["prompt_tokens"],
        gen_tokens=o["gen_tokens"],
        concurrency=parse_int_list(o["concurrency"]),
        shared_prefix=o["shared_prefix"],
        long_prompt=o["long_prompt"],
        chunk=o["chunk"],
        pool_sizes=parse_size_list(o["pool_sizes"]),
        compare_mlx_lm=o["compare_mlx_lm"],
        compare_cpu_layer=o["compare_cpu_layer"],
        seed=o["seed"],
        speculative=speculative,
        workloads=tuple(w.strip() for w in o["workload"].split(",") if w.strip()),
        spec_repeats=o["spec_repeats"],
    )


def _print_bench(report: dict, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
        print(f"distributed: {json.dumps(report['distributed'])}" if report["distributed"] else "", end="")


def _bench_synthetic(
    model: str | None, sizes: str, bits: int, gen_tokens: int, seed: int, device: str, as_json: bool
) -> None:
    from baselm.backend import select_backend
    from baselm.commands.bench_synthetic import render_synthetic, run_synthetic

    if model is not None or not sizes:
        _fail("give either a model or --synthetic SIZES")
    if bits not in (4, 8, 32):
        _fail(f"--synthetic-bits must be 4, 8 or 32, got {bits}")
    try:
        names = [s.strip() for s in sizes.split(",") if s.strip()]
        report = run_synthetic(names, None if bits == 32 else bits, select_backend(device), gen_tokens, seed)
    except _user_errors() as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render_synthetic(report)


API_KEY_HELP = "Require 'Authorization: Bearer KEY' (env BASE_API_KEY)."
SEED_HELP = "Seed of the sampling of requests that bring none (default: random), for reproducible runs."


@app.command()
def serve(
    model: str = typer.Argument(..., help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="BASE_API_KEY", help=API_KEY_HELP),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name clients send."),
    kv_memory: str | None = typer.Option(None, "--kv-memory", help="Memory for the KV cache, e.g. 2GiB."),
    kv_bits: int = typer.Option(16, "--kv-bits", help="KV cache precision: 16 (model dtype), 8 or 4."),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Requests running at once."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context length cap."),
    max_num_batched_tokens: int = typer.Option(1024, "--max-num-batched-tokens", help="Tokens per engine step."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Turn prefix caching off."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Queued requests beyond this get 429."),
    max_body: str = typer.Option("8MiB", "--max-body", help="Largest request body accepted (413 past it)."),
    prefix_cache_file_path: str | None = typer.Option(None, "--prefix-cache-file", help=PREFIX_FILE_HELP),
    prefix_cache_save_interval: float = typer.Option(300.0, "--prefix-cache-save-interval", help=PREFIX_SAVE_HELP),
    prefix_cache_max_size: str | None = typer.Option(None, "--prefix-cache-max-size", help=PREFIX_MAX_HELP),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help=SHUTDOWN_HELP),
    cors_origins: str = typer.Option("", "--cors-origins", help=CORS_HELP),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    require_signature: bool = typer.Option(False, "--require-signature", help=REQUIRE_SIGNATURE_HELP),
    speculative: str | None = typer.Option(None, "--speculative", help=SPEC_HELP),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help=SPEC_K_HELP),
    seed: int | None = typer.Option(None, "--seed", help=SEED_HELP),
    pd: str | None = typer.Option(None, "--pd", help=PD_HELP),
    role: str | None = typer.Option(None, "--role", help=ROLE_HELP),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = cli_dist.MOE_SPLIT,
) -> None:
    """Serve a model over the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models."""
    from baselm.api.server import ServeOptions, exit_process, run_server
    from baselm.distributed.launch import load_model_for
    from baselm.toolcalls.forcing import model_processor_factory as constraints

    try:
        dist = dist_options(tensor_parallel, hostfile, rank, moe_split)
        dist, prefix_file = prefix_cache_file(dist, prefix_cache_file_path)  # --pd: per prefill rank; TP: per rank
        config = EngineConfig(
            kv_memory=parse_optional_size(kv_memory),
            kv_bits=kv_bits,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=not no_prefix_caching,
            max_waiting=max_waiting,
            prefix_cache_file=prefix_file,
            prefix_cache_save_interval=prefix_cache_save_interval,
            prefix_cache_max_size=parse_optional_size(prefix_cache_max_size),
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens),
            seed=seed,
        )
        options = ServeOptions(host, port, api_key or None, served_model_name, parse_size(max_body), shutdown_timeout)
        options.cors_origins = tuple(o.strip() for o in cors_origins.split(",") if o.strip())
        serve_pd((pd, role, dist), (model, device, require_signature), config, options, run_server, constraints)
        loaded = load_model_for(model, device, require_signature, dist)
    except _user_errors() as exc:
        _fail(str(exc))
    exit_process(run_server(loaded, config, options))


app.registered_commands[:0] = store_commands.commands.registered_commands  # pull, rm, inspect: listed first
app.registered_commands += signing_commands.commands.registered_commands  # keygen, sign, verify
app.registered_commands += perplexity_command.commands.registered_commands


def main() -> None:
    app()


if __name__ == "__main__":
    main()
