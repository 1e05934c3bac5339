"""Signing and verifying whole `.base` files (see signing.py for keys, statements and the trust rule)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import xxhash

from baselm.store.base_header import check_digest
from baselm.store.base_reader import BaseFile, read_chunks
from baselm.store.errors import SignatureError
from baselm.store.progress import NoProgress, Progress
from baselm.store.signing import (
    PublicKey,
    check_signature,
    find_signature,
    header_digest,
    read_private_key,
    sidecar,
    sign_statement,
    statement,
    trusted_keys,
    write_sidecar,
)


def region_digests(base: BaseFile, progress: Progress | None = None) -> dict[str, str]:
    """SHA-256 of every tensor region, streamed once; each region's xxh64 is checked on the way.
    `progress` hears of the bytes read."""
    digests = {}
    progress = progress or NoProgress()
    progress.start(base.path.name, sum(entry.length for entry in base.tensors.values()), 0)
    with base.file() as f:
        for name, entry in base.tensors.items():
            sha, xxh = hashlib.sha256(), xxhash.xxh64()
            for chunk in read_chunks(base.path, f, base.blob_start + entry.offset, entry.length):
                sha.update(chunk)
                xxh.update(chunk)
                progress.advance(len(chunk))
            check_digest(base.path, entry, xxh.hexdigest())
            digests[name] = sha.hexdigest()
    progress.finish()
    return digests


def sign_file(path: Path, key_path: Path, embed: bool = False) -> tuple[PublicKey, Path]:
    """Signs `path` with the private key at `key_path`: into `<path>.sig`, or into its header when `embed`.
    Returns the signer's public key and where the signature went."""
    private, public = read_private_key(key_path)
    base = BaseFile.open(path)
    base.verify()  # never sign a file that already fails its own checksums
    signed = sign_statement(statement(base.header, region_digests(base)), private, public)
    if embed:
        embed_signature(base, signed)
        sidecar(path).unlink(missing_ok=True)
        return public, path
    if "signature" in base.header:
        raise SignatureError(f"{path} carries a signature in its header; sign with --embed to replace it")
    return public, write_sidecar(path, signed)


def embed_signature(base: BaseFile, signed: dict[str, Any]) -> None:
    """Rewrites the file with `signed` in its header (a copy, published by rename: a kill leaves the old file)."""
    from baselm.store.base_writer import rewrite_header
    from baselm.store.fs import atomic_write

    header = {k: v for k, v in base.header.items() if k not in ("header_xxh64", "signature")}
    header["signature"] = signed
    blob_len = base.path.stat().st_size - base.blob_start
    with atomic_write(base.path, "w+b") as out, open(base.path, "rb") as src:
        shutil.copyfileobj(src, out, 8 * 2**20)
        rewrite_header(out, header, base.blob_start, blob_len)


def signed_statement(base: BaseFile, keys: dict[str, PublicKey] | None = None) -> tuple[dict[str, Any], PublicKey]:
    """The checked statement of an opened file: signature, signer trust and header digest all hold.
    Tensor digests are still to be compared (`verify_file`, or `BaseFile.load(digests=...)`)."""
    signed = find_signature(base.path, base.header)
    if signed is None:
        raise SignatureError(f"{base.path} is not signed (no {sidecar(base.path).name} and none in its header)")
    stmt, key = check_signature(signed, trusted_keys() if keys is None else keys, str(base.path))
    if stmt.get("header_sha256") != header_digest(base.header):
        raise SignatureError(
            f"{base.path}: its header differs from the one that was signed (the file was changed, re-quantized "
            "or converted after signing)"
        )
    if set(stmt["tensors_sha256"]) != set(base.tensors):
        raise SignatureError(f"{base.path}: its tensors differ from the ones that were signed")
    return stmt, key


def verify_file(path: Path, keys: dict[str, PublicKey] | None = None, progress: Progress | None = None) -> PublicKey:
    """Checks the signature, the header and every tensor of `path`; returns the signer. Raises SignatureError.
    `progress` hears of the bytes read."""
    base = BaseFile.open(path)
    stmt, key = signed_statement(base, keys)
    for name, digest in region_digests(base, progress).items():
        if digest != stmt["tensors_sha256"][name]:
            raise SignatureError(f"{path}: tensor {name!r} differs from the one that was signed")
    return key


def keys_with(pubkey: Path | None) -> dict[str, PublicKey]:
    """The trusted keys, plus `pubkey` when given."""
    keys = trusted_keys()
    if pubkey is not None:
        key = PublicKey.read(pubkey)
        keys[key.key_id] = key
    return keys
