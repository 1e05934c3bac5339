"""The `base` command line: Typer declarations, whose options are parsed once into typed options and
handed to the commands (baselm/commands/), which do the work.

Heavy modules (MLX, the engine, rich, the HTTP server) are imported inside the commands, so `--help` is instant."""

from __future__ import annotations

import json
import sys

import typer

from baselm.commands import perplexity as perplexity_command
from baselm.commands import signing as signing_commands
from baselm.commands import store as store_commands
from baselm.commands.errors import fail, report_user_errors
from baselm.commands.model import ModelArgs
from baselm.commands.options import (
    DEVICE,
    FIXED_SPECULATION,
    HOSTFILE,
    KV_BITS,
    MODEL_HELP,
    MOE_SPLIT,
    NUM_SPECULATIVE_TOKENS,
    RANK,
    REQUIRE_SIGNATURE,
    SPECULATIVE,
    TENSOR_PARALLEL,
    GenerationOptions,
    dist_options,
    generation_options,
    with_prefix_cache_file,
)
from baselm.config import (
    EngineConfig,
    SpeculativeConfig,
    parse_int_list,
    parse_name_list,
    parse_optional_size,
    parse_size,
    parse_size_list,
)

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
MAX_CONNECTIONS_HELP = "Connections open at once, idle ones included; past it a request gets 503."
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
WORKLOAD_HELP = "With --speculative: grounded (answers copy the prompt), free, random; comma-separated."
KV_MEMORY_HELP = "Memory for the KV cache, e.g. 2GiB (default: from the context and the sequences)."
SYNTHETIC_HELP = (
    "Instead of a model: random-weight models of these sizes (135M,360M,1B), decode tok/s beside the roofline."
)
CPU_LAYER_HELP = "Also decode one stream with the CPU decoder-layer kernel on and off."
API_KEY_HELP = "Require 'Authorization: Bearer KEY' (env BASE_API_KEY)."
API_KEY_FILE_HELP = "Read the key from this file (its one line), out of sight of ps; instead of --api-key."
LOG_FORMAT_HELP = "The log's lines: text, or json (one object a line); a line per request either way."


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the models in the local store."""
    from baselm.commands.list import list_models as list_stored

    list_stored(as_json)


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


@app.command()
@generation_options
def run(
    generation: GenerationOptions,
    model: str = typer.Argument(..., help=MODEL_HELP),
    prompt: str = typer.Argument(..., help="The prompt. Use - to read it from standard input."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, not through the chat template."),
    logprobs: int | None = typer.Option(
        None, "--logprobs", help="Return log-probabilities with the top K alternatives."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    device: str = DEVICE,
    require_signature: bool = REQUIRE_SIGNATURE,
    speculative: str | None = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    fixed_speculation: bool = FIXED_SPECULATION,
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
) -> None:
    """Generate once from a prompt and print the answer with its speed."""
    from baselm.commands.run import RunArgs, run_once

    with report_user_errors():
        args = RunArgs(
            ModelArgs(model, device, require_signature, dist_options(tensor_parallel, hostfile, rank, moe_split)),
            sys.stdin.read() if prompt == "-" else prompt,
            generation,
            logprobs=logprobs,
            raw=raw,
            as_json=as_json,
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens, adaptive=not fixed_speculation),
        )
        run_once(args)


@app.command()
@generation_options
def chat(
    generation: GenerationOptions,
    model: str = typer.Argument(..., help=MODEL_HELP),
    system: str | None = typer.Option(None, "--system", help="System prompt for the conversation."),
    device: str = DEVICE,
    kv_memory: str | None = typer.Option(None, "--kv-memory", help=KV_MEMORY_HELP),
    kv_bits: int = KV_BITS,
    serve: bool = typer.Option(False, "--serve", help="Also serve the HTTP API on the same engine."),
    port: int = typer.Option(8080, "--port", help="Port for --serve."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address for --serve."),
    require_signature: bool = REQUIRE_SIGNATURE,
    resume: bool = typer.Option(False, "--resume", help="Reopen the last conversation (its prompt comes cached)."),
    prefix_cache_file: str = typer.Option(
        "auto", "--prefix-cache-file", help="Keep the prefix cache here across runs (auto: per model; none: off)."
    ),
    prefix_cache_max_size: str | None = typer.Option(
        None, "--prefix-cache-max-size", help="Most K/V the prefix cache file holds, e.g. 1GiB (default: the pool)."
    ),
    speculative: str | None = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
) -> None:
    """Chat with a model in the terminal (/help inside for commands)."""
    from baselm.chat.settings import ChatOptions, chat_prefix_cache_file
    from baselm.commands.chat import ChatArgs, ServeError, chat_serve_options
    from baselm.commands.chat import chat as run_chat

    with report_user_errors(ServeError):
        prefix_file = chat_prefix_cache_file(prefix_cache_file, model)
        dist = with_prefix_cache_file(dist_options(tensor_parallel, hostfile, rank, moe_split), prefix_file)
        config = EngineConfig(
            kv_memory=parse_optional_size(kv_memory),
            kv_bits=kv_bits,
            max_num_seqs=16 if serve else 1,  # the REPL runs one request at a time; --serve, as serve does
            prefix_cache_file=prefix_file,
            prefix_cache_max_size=parse_optional_size(prefix_cache_max_size),
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens),
        )
        args = ChatArgs(
            ModelArgs(model, device, require_signature, dist),
            ChatOptions(config, system=system, resume=resume),
            generation,
            chat_serve_options(host, port) if serve else None,
        )
        run_chat(args)


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
    kv_memory: str | None = typer.Option(None, "--kv-memory", help=KV_MEMORY_HELP),
    kv_bits: int = KV_BITS,
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(1024, "--max-num-batched-tokens", help="Token budget per step."),
    seed: int = typer.Option(0, "--seed", help="Seed for the random prompts."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    device: str = DEVICE,
    speculative: str | None = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    fixed_speculation: bool = FIXED_SPECULATION,
    workload: str = typer.Option("grounded,free", "--workload", help=WORKLOAD_HELP),
    spec_repeats: int = typer.Option(2, "--spec-repeats", help="Speculative: alternating runs of each, best kept."),
    synthetic: str = typer.Option("", "--synthetic", help=SYNTHETIC_HELP),
    synthetic_bits: int = typer.Option(4, "--synthetic-bits", help="4 or 8 (affine, groups of 32), 32: float32."),
    pd: str | None = typer.Option(None, "--pd", help="Also run the batch (the last --concurrency) on a P:D group."),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
) -> None:
    """Measure prefill and decode speed, latency and memory of the engine on a model (with
    --speculative, also each workload with and without speculative decoding, side by side)."""
    from baselm.commands import bench as command

    if synthetic or model is None:  # random-weight models instead of a model
        return _bench_synthetic(model, synthetic, synthetic_bits, device, gen_tokens, seed, as_json)
    with report_user_errors():
        engine = _bench_engine(kv_memory, kv_bits, max_num_seqs, max_num_batched_tokens)
        loaded = ModelArgs(model, device, dist=dist_options(tensor_parallel, hostfile, rank, moe_split))
        if pd is not None:  # one process, then a prefill/decode group, on the same batch
            return _bench_pd(loaded, pd, engine, prompt_tokens, gen_tokens, concurrency, seed, as_json)
        options = command.BenchOptions(
            prompt_tokens=prompt_tokens,
            gen_tokens=gen_tokens,
            concurrency=parse_int_list(concurrency),
            shared_prefix=shared_prefix,
            long_prompt=long_prompt,
            chunk=chunk,
            pool_sizes=parse_size_list(pool_sizes),
            compare_mlx_lm=compare_mlx_lm,
            compare_cpu_layer=compare_cpu_layer,
            seed=seed,
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens, adaptive=not fixed_speculation),
            workloads=parse_name_list(workload),
            spec_repeats=spec_repeats,
        )
    command.bench(command.BenchArgs(loaded, engine, options, as_json))


def _bench_engine(kv_memory: str | None, kv_bits: int, max_num_seqs: int, max_num_batched_tokens: int) -> EngineConfig:
    """The engine `base bench` measures: its KV pool and its batch limits."""
    return EngineConfig(
        kv_memory=parse_optional_size(kv_memory),
        kv_bits=kv_bits,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def _bench_synthetic(
    model: str | None, sizes: str, bits: int, device: str, gen_tokens: int, seed: int, as_json: bool
) -> None:
    """`base bench --synthetic SIZES`: random-weight models instead of `model` (never both)."""
    from baselm.commands.bench_synthetic import SyntheticArgs, bench_synthetic

    if model is not None or not sizes:
        fail("give either a model or --synthetic SIZES")
    names = parse_name_list(sizes)
    with report_user_errors():
        args = SyntheticArgs(names, bits, device, gen_tokens, seed, as_json)
    bench_synthetic(args)


def _bench_pd(
    model: ModelArgs,
    pd: str,
    engine: EngineConfig,
    prompt_tokens: int,
    gen_tokens: int,
    concurrency: str,
    seed: int,
    as_json: bool,
) -> None:
    """`base bench MODEL --pd P:D`: the batch (the last --concurrency count) alone, then on the group."""
    from baselm.commands.bench_pd import PDBenchArgs, PDBenchOptions, bench_pd
    from baselm.distributed.pd.node import Layout

    batch = PDBenchOptions(prompt_tokens, gen_tokens, parse_int_list(concurrency)[-1], seed)
    bench_pd(PDBenchArgs(model, Layout.parse(pd), engine, batch, as_json))


@app.command()
@generation_options
def serve(
    generation: GenerationOptions,
    model: str = typer.Argument(..., help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="BASE_API_KEY", help=API_KEY_HELP),
    api_key_file: str | None = typer.Option(None, "--api-key-file", help=API_KEY_FILE_HELP),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name clients send."),
    kv_memory: str | None = typer.Option(None, "--kv-memory", help=KV_MEMORY_HELP),
    kv_bits: int = KV_BITS,
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Requests running at once."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context length cap."),
    max_num_batched_tokens: int = typer.Option(1024, "--max-num-batched-tokens", help="Tokens per engine step."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Turn prefix caching off."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Queued requests beyond this get 429."),
    max_body: str = typer.Option("8MiB", "--max-body", help="Largest request body accepted (413 past it)."),
    max_connections: int = typer.Option(512, "--max-connections", min=1, help=MAX_CONNECTIONS_HELP),
    prefix_cache_file: str | None = typer.Option(None, "--prefix-cache-file", help=PREFIX_FILE_HELP),
    prefix_cache_save_interval: float = typer.Option(300.0, "--prefix-cache-save-interval", help=PREFIX_SAVE_HELP),
    prefix_cache_max_size: str | None = typer.Option(None, "--prefix-cache-max-size", help=PREFIX_MAX_HELP),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help=SHUTDOWN_HELP),
    cors_origins: str = typer.Option("", "--cors-origins", help=CORS_HELP),
    allowed_hosts: str = typer.Option("", "--allowed-hosts", help=ALLOWED_HOSTS_HELP),
    device: str = DEVICE,
    require_signature: bool = REQUIRE_SIGNATURE,
    speculative: str | None = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    pd: str | None = typer.Option(None, "--pd", help=PD_HELP),
    role: str | None = typer.Option(None, "--role", help=ROLE_HELP),
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
    log_format: str = typer.Option("text", "--log-format", help=LOG_FORMAT_HELP),
) -> None:
    """Serve a model over the OpenAI, Anthropic and Ollama APIs, on one port."""
    from baselm.commands import serve as command

    with report_user_errors():
        dist = dist_options(tensor_parallel, hostfile, rank, moe_split)
        config = EngineConfig(
            kv_memory=parse_optional_size(kv_memory),
            kv_bits=kv_bits,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=not no_prefix_caching,
            max_waiting=max_waiting,
            prefix_cache_file=prefix_cache_file,  # --pd: per prefill rank; TP: per rank (see PREFIX_FILE_HELP)
            prefix_cache_save_interval=prefix_cache_save_interval,
            prefix_cache_max_size=parse_optional_size(prefix_cache_max_size),
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens),
        )
        api_key = command.api_key_option(api_key, api_key_file)
        server = command.ServeOptions(host, port, api_key, served_model_name, parse_size(max_body), shutdown_timeout)
        server.max_connections, server.log_format = max_connections, log_format
        server.cors_origins, server.allowed_hosts = parse_name_list(cors_origins), parse_name_list(allowed_hosts)
        model_args = ModelArgs(model, device, require_signature, with_prefix_cache_file(dist, prefix_cache_file))
        args = command.ServeArgs(model_args, config, server, generation, command.pd_options(pd, role, dist))
    command.serve(args)


app.registered_commands[:0] = store_commands.commands.registered_commands  # pull, rm, inspect: listed first
app.registered_commands += signing_commands.commands.registered_commands  # keygen, sign, verify
app.registered_commands += perplexity_command.commands.registered_commands


def main() -> None:
    app()


if __name__ == "__main__":
    main()
