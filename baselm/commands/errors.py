"""How every `base` command reports a user's mistake: one clear line on stderr, exit status 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer


def fail(message: str, code: int = 1) -> None:
    """Prints one clear error line and exits: user mistakes never show a traceback."""
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: one line whatever the width (rich would cut a long path at 80 columns in a pipe)
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def report_user_errors(*more: type[Exception]) -> Iterator[None]:
    """A user error raised in the block (`user_errors`, and `more`) is one clear line and exit status 1."""
    try:
        yield
    except (*user_errors(), *more) as exc:
        fail(str(exc))


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean a bad input or setting, not a bug."""
    from baselm.adapters import AdapterError
    from baselm.backend import BackendError
    from baselm.config import ConfigError
    from baselm.distributed.group import DistError
    from baselm.models.base import ModelConfigError
    from baselm.request import InvalidRequestError
    from baselm.sampling.params import SamplingParamsError
    from baselm.scheduler import RequestTooLongError
    from baselm.store.errors import StoreError
    from baselm.tokenizer.errors import TokenizerError

    return (
        AdapterError,
        BackendError,
        ConfigError,
        DistError,
        InvalidRequestError,
        ModelConfigError,
        RequestTooLongError,
        SamplingParamsError,
        StoreError,
        TokenizerError,
    )
