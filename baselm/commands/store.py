"""`base pull`, `base rm`, `base cp`, `base inspect`: the commands that bring models into the store and look at them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from baselm.commands.errors import fail as _fail
from baselm.commands.errors import user_errors as _user_errors
from baselm.commands.options import NO_MMPROJ, PULL_MMPROJ

if TYPE_CHECKING:
    from baselm.store.registry import StoredModel

commands = typer.Typer()  # merged into the `base` app by cli.py


@commands.command()
def pull(
    source: str = typer.Argument(
        ..., help="HF repo id (org/name[:variant]), an HF or MLX folder, a .gguf or .base file."
    ),
    quant: str | None = typer.Option(None, "--quant", "-q", help="q2, q3, q4, q5, q6, q8, f16, bf16 or f32."),
    group_size: int | None = typer.Option(None, "--group-size", help="Quantization group size: 32, 64 or 128."),
    profile: str | None = typer.Option(None, "--profile", help="Built-in profile name or a profile JSON file."),
    name: str | None = typer.Option(None, "--name", help="Store the model as org/name (local sources)."),
    revision: str = typer.Option("main", "--revision", help="Hub branch, tag or commit."),
    force: bool = typer.Option(False, "--force", help="Pull and convert again even if already stored."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    mmproj: str | None = PULL_MMPROJ,
    no_mmproj: bool = NO_MMPROJ,
) -> None:
    """Bring a model into the local store as a .base file."""
    from baselm.models import supported_model_types
    from baselm.store import pull as pulling
    from baselm.store.hub import MmprojChoice
    from baselm.store.import_local import import_local
    from baselm.store.progress import default_progress

    supported = set(supported_model_types())
    started = time.perf_counter()
    try:
        projector = MmprojChoice(mmproj, wanted=not no_mmproj)
        if Path(source).expanduser().exists():
            stored = import_local(
                Path(source).expanduser(),
                name=name,
                quant=quant,
                group_size=group_size,
                profile=profile,
                supported=supported,
                force=force,
                progress=default_progress(quiet, "check" if source.endswith(".base") else "convert"),
                mmproj=projector,
            )
        else:
            stored = pulling.pull(
                source,
                quant=quant,
                group_size=group_size,
                profile=profile,
                revision=revision,
                supported=supported,
                force=force,
                progress=default_progress(quiet),
                convert_progress=default_progress(quiet, "convert"),
                mmproj=projector,
            )
    except _user_errors() as exc:
        _fail(str(exc))
    if not quiet:
        print(stored_summary(stored, time.perf_counter() - started), file=sys.stderr)
    print(stored.ref)


def stored_summary(stored: StoredModel, seconds: float) -> str:
    """The closing line of a pull: the name, its size and quant, where the file is, and the time."""
    from baselm.store.fs import human_size

    origins = stored.source.get("tensors")
    how = ""
    if isinstance(origins, dict) and origins:
        parts = ", ".join(f"{count} {ORIGIN_WORDS.get(key, key)}" for key, count in origins.items())
        how = f" ({sum(origins.values())} tensors: {parts})"
    return (
        f"stored {stored.ref}: {human_size(stored.size)}, {stored.params / 1e6:.1f}M weights in {stored.quant}"
        f"{how}, {stored.path} ({seconds:.1f} s)"
    )


# How `stored_summary` names each kind of `Converted.tensors`.
ORIGIN_WORDS = {
    "exact": "kept exactly",
    "requantized": "requantized",
    "quantized": "quantized",
    "float": "float",
}


@commands.command()
def rm(model: str = typer.Argument(..., help="Store name (org/name:variant or an alias).")) -> None:
    """Remove a name from the local store, and its file when no other name points at it."""
    from baselm.store.fs import human_size
    from baselm.store.registry import Store

    store = Store()
    try:
        removed = store.remove(model)
    except _user_errors() as exc:
        _fail(str(exc))
    others = [m.ref for m in store.list() if removed.digest and m.digest == removed.digest]
    if others:
        print(f"removed {removed.ref} (its file stays, for {', '.join(others)})")
    else:
        print(f"removed {removed.ref} (freed {human_size(removed.size)})")


@commands.command()
def cp(
    source: str = typer.Argument(..., help="A stored model (org/name:variant or an alias)."),
    destination: str = typer.Argument(..., help="The new name, org/name[:variant] (name alone: local/name)."),
    force: bool = typer.Option(False, "--force", help="Point a name that already names another model at this one."),
) -> None:
    """Give a stored model a second name (the file is shared, not copied)."""
    from baselm.store.registry import Store

    store = Store()
    try:
        original = store.resolve(source)
        copied = store.copy(original.ref, destination, replace=force)
    except _user_errors() as exc:
        _fail(str(exc))
    print(f"copied {original.ref} to {copied.ref}")


@commands.command()
def inspect(
    model: str = typer.Argument(..., help="A .base file or a store name."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's checksum."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a .base file's header, tensor table and totals."""
    from baselm.loader import resolve
    from baselm.store.base_inspect import inspect_report, render_inspect

    try:
        _, path = resolve(model)
        report = inspect_report(path, verify=verify)
    except _user_errors() as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from baselm.commands.console import table_console

        render_inspect(report, table_console())
