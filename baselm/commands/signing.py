"""`base keygen`, `base sign`, `base verify`: the commands around signed `.base` files (store/signing.py)."""

from __future__ import annotations

from pathlib import Path

import typer

commands = typer.Typer()  # merged into the `base` app by cli.py


@commands.command()
def keygen(
    out: str = typer.Option(..., "--out", help="Folder for the key pair."),
    name: str = typer.Option("base", "--name", help="File name of the pair: NAME.key and NAME.pub."),
) -> None:
    """Make an ed25519 key pair for signing models."""
    from baselm.store.signing import keygen as make_keys
    from baselm.store.signing import trusted_keys_dir

    key, pub = _run(make_keys, Path(out).expanduser(), name)
    print(f"private key: {key} (keep it secret)\npublic key:  {pub}")
    print(f"to trust it on a machine: copy {pub.name} into {trusted_keys_dir()}")


@commands.command()
def sign(
    model: str = typer.Argument(..., help="A .base file or a store name."),
    key: str = typer.Option(..., "--key", help="The private key (NAME.key from base keygen)."),
    embed: bool = typer.Option(False, "--embed", help="Put the signature in the file's header, not beside it."),
) -> None:
    """Sign a model: its header and every tensor, by SHA-256."""
    from baselm.store.signed_file import sign_file

    path = _run(_base_path, model)
    public, where = _run(sign_file, path, Path(key).expanduser(), embed)
    print(f"signed {path} with key {public.key_id} ({public.name}); signature in {where}")


@commands.command()
def verify(
    model: str = typer.Argument(..., help="A .base file or a store name."),
    pubkey: str | None = typer.Option(None, "--pubkey", help="Also trust this public key (NAME.pub)."),
) -> None:
    """Check a model's signature, header and every tensor against a trusted key."""
    from baselm.store.progress import default_progress
    from baselm.store.signed_file import keys_with, verify_file

    path = _run(_base_path, model)
    keys = _run(keys_with, Path(pubkey).expanduser() if pubkey else None)
    key = _run(lambda: verify_file(path, keys, default_progress(kind="check")))
    print(f"{path}: good signature by key {key.key_id} ({key.name or 'unnamed'})")


def _base_path(model: str) -> Path:
    from baselm.loader import resolve
    from baselm.store.errors import SignatureError

    _, path = resolve(model)
    if path.suffix != ".base":
        raise SignatureError(f"{path}: only .base files are signed; `base pull` it into the store first")
    return path


def _run(fn, *args):
    """`fn(*args)`; a store error is one clear line and exit status 1, never a traceback."""
    from baselm.commands.errors import fail
    from baselm.store.errors import StoreError

    try:
        return fn(*args)
    except StoreError as exc:
        fail(str(exc))
