"""The options several `base` commands share, declared once here, and what they parse into.

A command declares `device: str = DEVICE` and so on; `dist_options` turns the distributed ones
into a `baselm.distributed.tp.launch.DistOptions` (imported lazily: MLX stays out of `base --help`),
and `SpeculativeConfig.parse` the speculative ones. `show_flags_bare` is how `--help` shows a flag.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from baselm.distributed.tp.launch import DistOptions


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
