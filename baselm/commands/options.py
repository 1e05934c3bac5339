"""The options several `base` commands share, declared once here, and what they parse into.

A command declares `device: str = DEVICE` and so on; `dist_options` turns the distributed ones
into a `baselm.distributed.tp.launch.DistOptions` (imported lazily: MLX stays out of `base --help`),
and `SpeculativeConfig.parse` the speculative ones. `show_flags_bare` is how `--help` shows a flag.
`run`, `chat` and `serve` take the generation options (`--temperature` ... `--max-tokens`,
`--runaway-guard`) through `@generation_options`, parsed into one `GenerationOptions`.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import typer

from baselm.commands.errors import report_user_errors
from baselm.config import DEFAULT_RUNAWAY_GUARD

if TYPE_CHECKING:
    from baselm.distributed.tp.launch import DistOptions
    from baselm.sampling.defaults import SamplingDefaults


def show_flags_bare() -> None:
    """Help shows a flag (`--json`, `--x/--no-x`) without a value, as click's plain help does: typer's
    rich help labels every option with its type, so a flag read `--json <bool>` as if it took one."""
    from typer.core import TyperOption

    typed = getattr(TyperOption, "display_type_rich", None)  # older typer shows flags bare already
    if typed is None or getattr(typed, "shows_flags_bare", False):
        return

    def display_type_rich(option: TyperOption, ctx: Any) -> str | None:
        return None if option.is_flag or option.count else typed(option, ctx)

    display_type_rich.shows_flags_bare = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


# The panels `--help` groups options in (typer's rich_help_panel); the rest stay in its first, Options.
PERFORMANCE = "Performance"
DISTRIBUTED = "Distributed"
SECURITY = "Security"


def in_panel(option: Any, panel: str) -> Any:
    """A copy of a shared option (a typer OptionInfo) that `--help` shows in `panel`: one command groups
    its options where another, with fewer, leaves them in Options."""
    moved = copy.copy(option)
    moved.rich_help_panel = panel
    return moved


DEVICE_HELP = "Where to run: auto (GPU when MLX has one), gpu or cpu."
MODEL_HELP = "Model: a store name (org/name[:variant] or an alias), a .base or .gguf file, or an HF folder."
KV_MEMORY_HELP = "Memory for the KV cache, e.g. 2GiB (default: from the context and the sequences)."

DEVICE = typer.Option("auto", "--device", help=DEVICE_HELP)
ADAPTER = typer.Option(
    [],
    "--adapter",
    help=(
        "A LoRA adapter merged into the weights as the model loads, for every request: an mlx-lm or PEFT folder "
        "or a GGUF LoRA, PATH[:scale]; repeatable (serve --lora serves adapters chosen per request instead)."
    ),
)
MMPROJ = typer.Option(
    None,
    "--mmproj",
    help="A vision projector GGUF (llama.cpp's mmproj file) for a .gguf model: the model then reads images.",
)
PULL_MMPROJ = typer.Option(
    None,
    "--mmproj",
    help=(
        "The vision projector a GGUF model takes into its .base file: a file of the hub repo (by default the one "
        "llama.cpp's -hf takes), or an mmproj .gguf for a local model."
    ),
)
NO_MMPROJ = typer.Option(False, "--no-mmproj", help="Leave a GGUF repo's or folder's vision projector out: text only.")
REQUIRE_SIGNATURE = typer.Option(
    False,
    "--require-signature",
    help="Refuse a model without a good signature by a trusted key (see base verify).",
    rich_help_panel=SECURITY,
)
KV_BITS = typer.Option(16, "--kv-bits", help="KV cache precision: 16 (model dtype), 8 or 4.")

SPECULATIVE = typer.Option(
    None, "--speculative", help="Speculative decoding: ngram (prompt lookup) or a draft model with the same tokenizer."
)
NUM_SPECULATIVE_TOKENS = typer.Option(
    4, "--num-speculative-tokens", help="Most speculative tokens a request verifies per step (with --speculative)."
)
FIXED_SPECULATION = typer.Option(
    False, "--fixed-speculation", help="Always verify --num-speculative-tokens drafts (no adaptive rule)."
)

TENSOR_PARALLEL = typer.Option(
    1,
    "--tensor-parallel",
    help="Split the model over N processes (tensor parallelism); without --hostfile, all on this machine.",
    rich_help_panel=DISTRIBUTED,
)
HOSTFILE = typer.Option(
    None,
    "--hostfile",
    help="MLX hostfile (JSON) of the processes' addresses, one per rank; with --rank.",
    rich_help_panel=DISTRIBUTED,
)
RANK = typer.Option(
    None,
    "--rank",
    help="This process's rank in --hostfile (rank 0 serves; the others follow).",
    rich_help_panel=DISTRIBUTED,
)
MOE_SPLIT = typer.Option(
    None,
    "--moe-split",
    help="How MoE experts split over the ranks: experts (whole experts per rank) or intermediate "
    "(every expert sliced on every rank; the default, faster as measured: see docs/distributed.md).",
    rich_help_panel=DISTRIBUTED,
)


def dist_options(
    tensor_parallel: int, hostfile: str | None, rank: int | None, moe_split: str | None = None
) -> DistOptions | None:
    """The parsed options, None when the model runs in this process alone."""
    if tensor_parallel == 1 and hostfile is None and rank is None:
        return None
    from baselm.distributed.tp.launch import DistOptions

    return DistOptions(tensor_parallel=tensor_parallel, hostfile=hostfile, rank=rank, moe_split=moe_split)


def with_prefix_cache_file(dist: DistOptions | None, path: str | None) -> DistOptions | None:
    """`dist` telling the ranks this process starts the prefix cache file too: across processes each
    rank R keeps its own KV heads in `path`.tpR (tp/persist.py)."""
    if dist is None or path is None:
        return dist
    return replace(dist, prefix_cache_file=path)


MODEL_ELSE = "Default: the model's own, else"
MAX_TOKENS_HELP = (
    "Most tokens of an answer that asks no limit (0: the context's room). Default: 2048, or half the context."
)
GUARD_HELP = "Cut an answer (finish_reason length) once it has repeated one n-gram for this many tokens (0: off)."
# The generation options: (parameter, type, declaration), in the order --help lists them.
_GENERATION_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("temperature", float | None, typer.Option(None, "--temperature", "-t", help=f"0: greedy. {MODEL_ELSE} 0.8.")),
    ("top_p", float | None, typer.Option(None, "--top-p", help=f"Nucleus sampling threshold. {MODEL_ELSE} 0.95.")),
    ("top_k", int | None, typer.Option(None, "--top-k", help=f"Among the K most likely (0: off). {MODEL_ELSE} 40.")),
    (
        "min_p",
        float | None,
        typer.Option(None, "--min-p", help=f"Drop tokens below this share of the best one. {MODEL_ELSE} 0.05."),
    ),
    (
        "repeat_penalty",
        float | None,
        typer.Option(None, "--repeat-penalty", help=f"On tokens seen before (1: off). {MODEL_ELSE} 1."),
    ),
    ("max_tokens", int | None, typer.Option(None, "--max-tokens", "-n", help=MAX_TOKENS_HELP)),
    (
        "seed",
        int | None,
        typer.Option(None, "--seed", help="Seed for reproducible sampling (serve: of requests that bring none)."),
    ),
    ("runaway_guard", int, typer.Option(DEFAULT_RUNAWAY_GUARD, "--runaway-guard", help=GUARD_HELP)),
)


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """The generation options, parsed: the defaults a request gets for what it leaves out (a request's
    own values win; baselm/sampling/defaults.py has the rule), the seed, and the runaway guard's length
    (EngineConfig.runaway_guard). The command layer applies them (`run`'s and `chat`'s seed is their
    requests'; `serve`'s the engine's, for the requests that bring none)."""

    sampling: SamplingDefaults
    seed: int | None = None
    runaway_guard: int = DEFAULT_RUNAWAY_GUARD

    @classmethod
    def parse(
        cls, seed: int | None, runaway_guard: int, repeat_penalty: float | None, **values: Any
    ) -> GenerationOptions:
        from baselm.sampling.defaults import SamplingDefaults  # MLX: not for `base --help`

        return cls(SamplingDefaults(repetition_penalty=repeat_penalty, **values), seed, runaway_guard)


def option_group(
    name: str, options: tuple[tuple[str, Any, Any], ...], parse: Callable[..., Any]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declares a group of options once: the command takes them as one parsed object, its parameter
    `name`, made by `parse(**values)` (a bad value is one clear error line). The options go after
    the command's own, keyword-only (typer calls every option by name)."""

    def declare(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != name]
        kind = inspect.Parameter.KEYWORD_ONLY
        added = [inspect.Parameter(key, kind, default=option, annotation=type_) for key, type_, option in options]

        @functools.wraps(command)
        def parsed(*args: Any, **kwargs: Any) -> None:
            values = {key: kwargs.pop(key) for key, _, _ in options}
            with report_user_errors():
                group = parse(**values)
            command(*args, **{name: group}, **kwargs)

        parsed.__signature__ = signature.replace(parameters=[*own, *added])
        parsed.__annotations__ = {k: v for k, v in command.__annotations__.items() if k != name}
        return parsed

    return declare


GENERATION_PANEL = "Sampling defaults"  # where --help shows the generation options


def generation_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declares the generation options once for `run`, `chat` and `serve`: `command` takes them parsed,
    as its first parameter (a `GenerationOptions`; a bad value is one clear error line)."""
    signature = inspect.signature(command, eval_str=True)
    own = list(signature.parameters.values())[1:]
    kind = inspect.Parameter.KEYWORD_ONLY
    added = [
        inspect.Parameter(name, kind, default=in_panel(option, GENERATION_PANEL), annotation=type_)
        for name, type_, option in _GENERATION_OPTIONS
    ]

    @functools.wraps(command)
    def parsed(**kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name, _, _ in _GENERATION_OPTIONS}
        with report_user_errors():
            generation = GenerationOptions.parse(**values)
        command(generation, **kwargs)

    # --help lists panels in the order of their first option: these come after the basics, before the rest.
    at = next((i for i, p in enumerate(own) if getattr(p.default, "rich_help_panel", None)), len(own))
    rest = [p.replace(kind=kind) for p in own[at:]]  # after keyword-only ones, as typer calls them all: by name
    parsed.__signature__ = signature.replace(parameters=[*own[:at], *added, *rest])
    first = next(iter(signature.parameters))
    parsed.__annotations__ = {k: v for k, v in command.__annotations__.items() if k != first}
    return parsed
