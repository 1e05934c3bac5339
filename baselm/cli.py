"""The `base` command line: Typer declarations, whose options are parsed once into typed options and
handed to the commands (baselm/commands/), which do the work.

Heavy modules (MLX, the engine, rich, the HTTP server) are imported inside the commands, so `--help` is instant."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import typer

from baselm.commands import perplexity as perplexity_command
from baselm.commands import serve_options as opt
from baselm.commands import signing as signing_commands
from baselm.commands import store as store_commands
from baselm.commands.errors import fail, report_user_errors
from baselm.commands.model import ModelArgs
from baselm.commands.options import (
    ADAPTER,
    DEVICE,
    DISTRIBUTED,
    FIXED_SPECULATION,
    HOSTFILE,
    KV_BITS,
    KV_MEMORY_HELP,
    MMPROJ,
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
    show_flags_bare,
    with_prefix_cache_file,
)
from baselm.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    EngineConfig,
    SpeculativeConfig,
    parse_int_list,
    parse_name_list,
    parse_optional_size,
    parse_size_list,
)

if TYPE_CHECKING:
    from baselm.api.server import ServeOptions
    from baselm.commands.chat import ChatArgs

app = typer.Typer(
    name="base",
    help="base: run LLMs locally on MLX. Chat in the terminal, or serve the OpenAI, Anthropic and Ollama APIs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
show_flags_bare()

WORKLOAD_HELP = "With --speculative: grounded (answers copy the prompt), free, random; comma-separated."
SYNTHETIC_HELP = (
    "Instead of a model: random-weight models of these sizes (135M,360M,1B), decode tok/s beside the roofline."
)
CPU_LAYER_HELP = "Also decode one stream with the CPU decoder-layer kernel on and off."


def _print_version(asked: bool) -> None:
    if asked:
        from baselm import version

        print(f"base {version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", "-v", is_eager=True, callback=_print_version, help="Print base's version and exit."
    ),
) -> None:
    """The options of `base` itself, before a command."""


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the models in the local store."""
    from baselm.commands.list import list_models as list_stored

    list_stored(as_json)


@app.command()
def show(
    model: str = typer.Argument(..., help="A store name or a .base file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    template: bool = typer.Option(False, "--template", help="Print only the chat template, whole."),
) -> None:
    """Show a model: architecture, parameters, context length, quantization, chat template, license."""
    from baselm.commands.show import ShowError, show_model

    with report_user_errors(ShowError):
        show_model(model, as_json, template)


@app.command()
def ps(
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address of the server to ask."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port of the server to ask."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="BASE_API_KEY", help="The server's API key."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's answer as JSON."),
) -> None:
    """Show what a running base serve has loaded (its /api/ps)."""
    from baselm.commands.ps import PsArgs, PsError
    from baselm.commands.ps import ps as show_running

    with report_user_errors(PsError):
        show_running(PsArgs(host, port, api_key, as_json))


@app.command()
def doctor(
    model: str | None = typer.Argument(
        None, help="A GGUF, .base file, model folder or store name: what base will do with each tensor type."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    links: bool = typer.Option(False, "--links", help="Also time a 2-process ring all_sum over loopback."),
    speed: bool = typer.Option(True, "--speed/--no-speed", help="Measure the decode speed to expect (~2 s)."),
) -> None:
    """Check this machine: Python, MLX, backend, memory, BLAS, kernels, store, distributed backends, and
    the decode speed to expect; with MODEL, what base will do with that model (nothing is converted)."""
    from baselm.commands.doctor import collect, render
    from baselm.commands.doctor_model import model_report, render_model

    with report_user_errors():
        about = model_report(model) if model else None
    report = collect(links, speed)
    if as_json:
        print(json.dumps({**report, "model": about} if about else report, indent=2))
        return
    render(report)
    if about:
        print("\n".join(["", *render_model(about)]))


@app.command()
@generation_options
def run(
    generation: GenerationOptions,
    model: str = typer.Argument(..., help=MODEL_HELP),
    prompt: str | None = typer.Argument(
        None, help="The prompt (- reads it from standard input). Without one, a chat opens, as base chat MODEL."
    ),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, not through the chat template."),
    logprobs: int | None = typer.Option(
        None, "--logprobs", help="Return log-probabilities with the top K alternatives."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    pull: bool = typer.Option(False, "--pull", help="Pull a hub model that is not in the store, without asking."),
    device: str = DEVICE,
    adapter: list[str] = ADAPTER,
    mmproj: str | None = MMPROJ,
    require_signature: bool = REQUIRE_SIGNATURE,
    speculative: str | None = SPECULATIVE,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    fixed_speculation: bool = FIXED_SPECULATION,
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
) -> None:
    """Answer a prompt and print it with its speed; without a prompt, chat (a hub model not yet stored
    is pulled after a yes)."""
    from baselm.commands import run as command
    from baselm.commands.model import pull_if_missing

    if prompt is None and (raw or as_json or logprobs is not None):
        fail("--raw, --json and --logprobs need a prompt: base run MODEL PROMPT")
    with report_user_errors():
        dist = dist_options(tensor_parallel, hostfile, rank, moe_split)
        loaded = ModelArgs(model, device, require_signature, dist, tuple(adapter), mmproj=mmproj)
        spec = SpeculativeConfig.parse(speculative, num_speculative_tokens, adaptive=not fixed_speculation)
        if prompt is None:
            return _chat_instead(command.chat_instead(loaded, generation, spec), pull)
        text = sys.stdin.read() if prompt == "-" else prompt
        args = command.RunArgs(loaded, text, generation, logprobs=logprobs, raw=raw, as_json=as_json, speculative=spec)
        pull_if_missing(model, pull)
        command.run_once(args)


def _chat_instead(args: ChatArgs, pull: bool) -> None:
    """`base run MODEL` without a prompt: `base chat MODEL`, once the model is in the store."""
    from baselm.commands.chat import ServeError
    from baselm.commands.chat import chat as run_chat
    from baselm.commands.model import pull_if_missing

    with report_user_errors(ServeError):
        pull_if_missing(args.model.ref, pull)
        run_chat(args)


@app.command()
@generation_options
def chat(
    generation: GenerationOptions,
    model: str = typer.Argument(..., help=MODEL_HELP),
    system: str | None = typer.Option(None, "--system", help="System prompt for the conversation."),
    device: str = DEVICE,
    adapter: list[str] = ADAPTER,
    mmproj: str | None = MMPROJ,
    kv_memory: str | None = typer.Option(None, "--kv-memory", help=KV_MEMORY_HELP),
    kv_bits: int = KV_BITS,
    serve: bool = typer.Option(False, "--serve", help="Also serve the HTTP API on the same engine."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port for --serve."),
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address for --serve."),
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
        # An adapter changes every K/V: the file of the model's own prefix cache is not for it.
        prefix_file = chat_prefix_cache_file(
            "none" if adapter and prefix_cache_file == "auto" else prefix_cache_file, model
        )
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
            ModelArgs(model, device, require_signature, dist, tuple(adapter), mmproj=mmproj),
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
    pd: str | None = typer.Option(
        None, "--pd", help="Also run the batch (the last --concurrency) on a P:D group.", rich_help_panel=DISTRIBUTED
    ),
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


def _set_browser_access(server: ServeOptions, cors_origins: str, allowed_hosts: str, webui: bool) -> None:
    """What browsers meet: the web origins whose pages may call the API, the Host names answered, the chat page."""
    server.cors_origins, server.allowed_hosts = parse_name_list(cors_origins), parse_name_list(allowed_hosts)
    server.webui = webui


def _serve_engine(
    kv_memory: str | None,
    kv_bits: int,
    max_num_seqs: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    max_waiting: int,
) -> EngineConfig:
    """The engine `base serve` runs (each model's, with several): its KV pool, batch and queue limits."""
    return EngineConfig(
        kv_memory=parse_optional_size(kv_memory),
        kv_bits=kv_bits,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=max_waiting,
    )


def _prefix_cache_settings(off: bool, file: str | None, save_interval: float, max_size: str | None) -> dict:
    """EngineConfig's prefix-cache fields from serve's four options (--pd: a file per prefill rank; TP: per rank)."""
    return {
        "enable_prefix_caching": not off,
        "prefix_cache_file": file,
        "prefix_cache_save_interval": save_interval,
        "prefix_cache_max_size": parse_optional_size(max_size),
    }


@app.command()
@generation_options
@opt.server_limit_options
def serve(
    generation: GenerationOptions,
    limits: opt.ServerLimits,
    models: list[str] | None = opt.SERVE_MODELS,
    host: str = opt.HOST,
    port: int = opt.PORT,
    served_model_name: str | None = opt.SERVED_MODEL_NAME,
    webui: bool = opt.WEBUI,
    device: str = DEVICE,
    adapter: list[str] = ADAPTER,
    lora: list[str] = opt.LORA,
    mmproj: str | None = MMPROJ,
    kv_memory: str | None = opt.KV_MEMORY,
    kv_bits: int = opt.SERVE_KV_BITS,
    max_num_seqs: int = opt.MAX_NUM_SEQS,
    max_model_len: int | None = opt.MAX_MODEL_LEN,
    max_num_batched_tokens: int = opt.MAX_NUM_BATCHED_TOKENS,
    no_prefix_caching: bool = opt.NO_PREFIX_CACHING,
    prefix_cache_file: str | None = opt.PREFIX_CACHE_FILE,
    prefix_cache_save_interval: float = opt.PREFIX_CACHE_SAVE_INTERVAL,
    prefix_cache_max_size: str | None = opt.PREFIX_CACHE_MAX_SIZE,
    speculative: str | None = opt.SERVE_SPECULATIVE,
    num_speculative_tokens: int = opt.SERVE_NUM_SPECULATIVE_TOKENS,
    max_waiting: int = opt.MAX_WAITING,
    keep_alive: str = opt.KEEP_ALIVE,
    max_loaded_models: int = opt.MAX_LOADED_MODELS,
    memory_budget: str | None = opt.MEMORY_BUDGET,
    tensor_parallel: int = TENSOR_PARALLEL,
    hostfile: str | None = HOSTFILE,
    rank: int | None = RANK,
    moe_split: str | None = MOE_SPLIT,
    pd: str | None = opt.PD,
    role: str | None = opt.ROLE,
    api_key: str | None = opt.API_KEY,
    api_key_file: str | None = opt.API_KEY_FILE,
    allowed_hosts: str = opt.ALLOWED_HOSTS,
    cors_origins: str = opt.CORS_ORIGINS,
    require_signature: bool = REQUIRE_SIGNATURE,
) -> None:
    """Serve models over HTTP, on one port: the OpenAI (/v1), Anthropic (/v1/messages) and Ollama (/api) APIs."""
    from baselm.commands import serve as command

    with report_user_errors():
        dist = dist_options(tensor_parallel, hostfile, rank, moe_split)
        spec = SpeculativeConfig.parse(speculative, num_speculative_tokens)
        prefix = _prefix_cache_settings(
            no_prefix_caching, prefix_cache_file, prefix_cache_save_interval, prefix_cache_max_size
        )
        config = _serve_engine(kv_memory, kv_bits, max_num_seqs, max_model_len, max_num_batched_tokens, max_waiting)
        config = replace(config, speculative=spec, **prefix)
        server = command.ServeOptions(host, port, command.api_key_option(api_key, api_key_file), served_model_name)
        limits.apply(server)
        _set_browser_access(server, cors_origins, allowed_hosts, webui)
        model_args = command.model_args(
            models, device, require_signature, dist, prefix_cache_file, adapter, lora, mmproj
        )
        pool = command.pool_args(models, keep_alive, max_loaded_models, parse_optional_size(memory_budget))
        args = command.ServeArgs(model_args, config, server, generation, command.pd_options(pd, role, dist), pool)
    command.serve(args)


app.registered_commands[:0] = store_commands.commands.registered_commands  # pull, rm, inspect: listed first
app.registered_commands += signing_commands.commands.registered_commands  # keygen, sign, verify
app.registered_commands += perplexity_command.commands.registered_commands


def main() -> None:
    app()


if __name__ == "__main__":
    main()
