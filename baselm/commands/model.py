"""The model a command runs: which one, on which device, in this process alone or over a group.

`open_model` loads it with `baselm.loader.load_model` when one process runs it, and only over
several processes (--tensor-parallel, --hostfile) goes through `baselm.distributed.tp.launch`.
On a rank other than 0 of such a group the command does not go on: it follows rank 0, and ends
with the status `run_follower` returns, written where the command calls it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baselm.distributed.group import DistGroup
    from baselm.distributed.tp.launch import DistOptions
    from baselm.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The model a command loads, where it runs, and over which processes."""

    ref: str  # a store name, a .base or .gguf file, or an HF folder
    device: str = "auto"
    require_signature: bool = False  # refuse a model without a good signature by a trusted key
    dist: DistOptions | None = None  # the model over several processes; None: this one alone
    adapters: tuple[str, ...] = ()  # LoRA adapters added as it loads, each `PATH[:scale]` (baselm/adapters.py)
    served_adapters: tuple[str, ...] = ()  # LoRA adapters served per request, `NAME=PATH[:scale]` (serve --lora)
    mmproj: str | None = None  # a vision projector GGUF beside a .gguf model (store/gguf_mmproj.py)

    @property
    def is_distributed(self) -> bool:
        return self.dist is not None and self.dist.is_distributed


def warn_without_cpu_kernels(device: str) -> None:
    """One line on stderr at the start of `run`, `chat` and `serve` when the model will run on this
    CPU without baselm.cpu's compiled kernels (decode several times slower): why, and how to build
    them. Silent when BASE_CPU_KERNELS=0 turned them off (that was asked for), on a GPU, off Linux
    (where they are not built), and in a rank another base process started (its parent said it)."""
    from baselm import cpu
    from baselm.backend import gpu_kind
    from baselm.cpu.build import rebuild_command
    from baselm.distributed.group import PARENT_ENV

    if cpu.available() or cpu.status["reason"] == cpu.DISABLED or os.environ.get(PARENT_ENV):
        return
    runs_on_cpu = device == "cpu" or (device == "auto" and gpu_kind() is None)
    if runs_on_cpu and sys.platform.startswith("linux"):
        print(
            f"warning: CPU kernels not loaded ({cpu.status['reason']}): decode runs on MLX's own CPU ops, "
            f"several times slower. Build them: {rebuild_command()}",
            file=sys.stderr,
        )


def pull_if_missing(ref: str, pull: bool) -> None:
    """Before a command loads `ref`: a hub repo id (org/name[:variant]) that is neither a path here nor
    in the store is pulled, with `pull` or after a yes on a terminal (as `ollama run` does); otherwise
    an UnknownModelError says, in one line, how to pull it. Anything else is left to the loader."""
    from pathlib import Path

    from baselm.store.errors import StoreError
    from baselm.store.registry import Store, UnknownModelError, check_model_name, split_ref

    repo = split_ref(ref)[0]
    if Path(ref).expanduser().exists() or repo.endswith((".gguf", ".base", ".safetensors")):
        return  # a path: the loader says what is wrong with it
    try:
        check_model_name(repo)
    except StoreError:
        return
    try:
        Store().resolve(ref)
        return
    except UnknownModelError:
        pass
    if not pull and not _asked_yes(f"{ref} is not in the store. Pull it from the Hugging Face hub? [y/N] "):
        raise UnknownModelError(
            f"{ref} is not in the store (base list shows what is); pull it with `base pull {ref}`, "
            "or run again with --pull"
        )
    from baselm.models import supported_model_types
    from baselm.store import pull as pulling
    from baselm.store.progress import default_progress

    progress, convert_progress = default_progress(), default_progress(kind="convert")
    stored = pulling.pull(
        ref, supported=set(supported_model_types()), progress=progress, convert_progress=convert_progress
    )
    print(f"pulled {stored.ref}", file=sys.stderr)


def _asked_yes(question: str) -> bool:
    """A yes to `question` on a terminal; False when nobody can answer (standard input is not one)."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    print(question, end="", file=sys.stderr, flush=True)
    try:
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False


def load_alone(args: ModelArgs) -> LoadedModel:
    """The whole model in this process."""
    from baselm.adapters import read_adapter
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from baselm.served_adapters import AdapterSpec

    adapters = [read_adapter(spec) for spec in args.adapters]  # first: a bad adapter costs no model load
    served = [AdapterSpec.read(spec) for spec in args.served_adapters]
    return load_model(
        args.ref,
        select_backend(args.device),
        require_signature=args.require_signature,
        adapters=adapters,
        served_adapters=served,
        mmproj=args.mmproj,
    )


def open_model(args: ModelArgs) -> tuple[LoadedModel, DistGroup | None]:
    """The model and, over several processes, this rank's group (None: this process alone). On rank 0
    the model leads the group's forwards; on another rank the caller runs `run_follower`."""
    if not args.is_distributed:
        return load_alone(args), None
    if args.adapters or args.served_adapters:
        from baselm.adapters import AdapterError

        option = "--adapter" if args.adapters else "--lora"
        raise AdapterError(f"{option} is not supported over several processes yet; run the model in one")
    if args.mmproj:
        from baselm.config import ConfigError

        raise ConfigError("--mmproj is not supported over several processes yet; run the model in one")
    from baselm.distributed.tp.launch import load

    return load(args.ref, args.device, args.require_signature, args.dist)


def is_follower(group: DistGroup | None) -> bool:
    """A rank other than 0 of a tensor-parallel group: it follows rank 0 instead of running the command."""
    return group is not None and group.rank != 0


def release_group(loaded: LoadedModel, group: DistGroup | None) -> None:
    """Rank 0 of a tensor-parallel group, before the process ends without exit handlers: stops the
    other ranks and waits for them to leave (see tp.launch.release); nothing without a group."""
    if group is not None:
        from baselm.distributed.tp import launch

        launch.release(loaded.model, group)


def run_follower(loaded: LoadedModel, group: DistGroup, dist: DistOptions) -> int:
    """Follows rank 0's forwards until it stops; returns the exit status (see tp.launch.run_follower)."""
    from baselm.distributed.tp import launch

    return launch.run_follower(loaded, group, dist.step_timeout, dist.prefix_cache_file)
