"""Signed `.base` files: ed25519 keys, detached or embedded signatures, verification at load.

A signature signs a *statement*: the SHA-256 of the header (its canonical JSON without
`header_xxh64` and `signature`) and the SHA-256 of every tensor region, by name. The header's
own xxh64 checksums find accidents, not forgeries (xxh64 collisions can be made at will), so the
statement carries cryptographic digests of its own; they are computed once, when signing.

Verifying is two steps that never read the file twice: the signature over the statement and
the header digest are checked when the file is opened (a few KB); each tensor's SHA-256 is
checked as the loader reads that tensor anyway (`BaseFile.load(digests=...)`), so a tampered
byte stops the load before the model runs. `base verify` streams every region once.

The signature lives beside the file (`<file>.sig`, JSON) or inside its header (`signature`).
Keys: `<name>.key` (PKCS#8 PEM, mode 0600) and `<name>.pub` (one line:
`base-ed25519 <base64 key> <name>`); trusted public keys are the `.pub` files in
`$BASE_HOME/trusted_keys/`. The library is `cryptography` (pyca): audited, maintained, with
wheels everywhere, and it already does ed25519 in constant time; hand-written crypto is not an option.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from baselm.store.base_format import canonical_json
from baselm.store.errors import SignatureError
from baselm.store.fs import atomic_write

FORMAT = "base-signature/1"
KEY_PREFIX = "base-ed25519"
SIG_SUFFIX = ".sig"
_UNSIGNED_KEYS = ("header_xxh64", "signature")  # header keys a signature cannot cover


@dataclass(frozen=True, slots=True)
class PublicKey:
    """An ed25519 public key, its name, and its id (first 16 hex digits of the SHA-256 of its bytes)."""

    raw: bytes
    name: str

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:16]

    def line(self) -> str:
        return f"{KEY_PREFIX} {base64.b64encode(self.raw).decode()} {self.name}\n"

    @classmethod
    def parse(cls, text: str, where: str) -> PublicKey:
        parts = text.strip().split(maxsplit=2)
        if len(parts) < 2 or parts[0] != KEY_PREFIX:
            raise SignatureError(f"{where} is not a base public key (expected '{KEY_PREFIX} <base64> [name]')")
        try:
            raw = base64.b64decode(parts[1], validate=True)
        except (binascii.Error, ValueError):
            raise SignatureError(f"{where}: the key is not valid base64") from None
        if len(raw) != 32:
            raise SignatureError(f"{where}: an ed25519 public key is 32 bytes, this one {len(raw)}")
        return cls(raw, parts[2] if len(parts) > 2 else "")

    @classmethod
    def read(cls, path: Path) -> PublicKey:
        try:
            return cls.parse(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as exc:
            raise SignatureError(f"cannot read the public key {path}: {exc}") from None


# ---- keys -----------------------------------------------------------------------------------


def keygen(folder: Path, name: str = "base") -> tuple[Path, Path]:
    """Writes `folder/name.key` (private, 0600) and `folder/name.pub`; refuses to overwrite."""
    if not name or "/" in name or name.startswith("."):
        raise SignatureError(f"key name {name!r} must be a plain file name")
    folder.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = folder / f"{name}.key", folder / f"{name}.pub"
    for path in (key_path, pub_path):
        if path.exists():
            raise SignatureError(f"{path} exists; remove it or choose another --name")
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_text(_public_of(private, name).line(), encoding="utf-8")
    return key_path, pub_path


def read_private_key(path: Path) -> tuple[Ed25519PrivateKey, PublicKey]:
    try:
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"cannot read the private key {path}: {exc}") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise SignatureError(f"{path} is not an ed25519 private key")
    return private, _public_of(private, path.stem)


def _public_of(private: Ed25519PrivateKey, name: str) -> PublicKey:
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PublicKey(raw, name)


def trusted_keys_dir() -> Path:
    from baselm.store.default_model import base_home

    return base_home() / "trusted_keys"


def trusted_keys(folder: Path | None = None) -> dict[str, PublicKey]:
    """The trusted public keys by id: every `.pub` file in `$BASE_HOME/trusted_keys/`."""
    folder = folder or trusted_keys_dir()
    keys = [PublicKey.read(p) for p in sorted(folder.glob("*.pub"))] if folder.is_dir() else []
    return {k.key_id: k for k in keys}


# ---- statements and signatures ----------------------------------------------------------------


def header_digest(header: dict[str, Any]) -> str:
    """SHA-256 of the header's canonical JSON without the keys a signature cannot cover."""
    body = {k: v for k, v in header.items() if k not in _UNSIGNED_KEYS}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def statement(header: dict[str, Any], tensor_digests: dict[str, str]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "header_sha256": header_digest(header),
        "tensors_sha256": dict(sorted(tensor_digests.items())),
    }


def sign_statement(stmt: dict[str, Any], private: Ed25519PrivateKey, public: PublicKey) -> dict[str, Any]:
    """The signature object, as stored in `<file>.sig` or in the header's `signature`."""
    signature = private.sign(canonical_json(stmt))
    return {
        "statement": stmt,
        "key_id": public.key_id,
        "signer": public.name,
        "public_key": base64.b64encode(public.raw).decode(),
        "signature": base64.b64encode(signature).decode(),
    }


def check_signature(signed: Any, keys: dict[str, PublicKey], where: str) -> tuple[dict[str, Any], PublicKey]:
    """(statement, signer) of a signature object whose signer is among `keys` and whose signature holds."""
    if not isinstance(signed, dict) or not isinstance(signed.get("statement"), dict):
        raise SignatureError(f"{where}: the signature is malformed")
    stmt = signed["statement"]
    if stmt.get("format") != FORMAT or not isinstance(stmt.get("tensors_sha256"), dict):
        raise SignatureError(f"{where}: the signature is not a {FORMAT} statement")
    key = keys.get(str(signed.get("key_id")))
    if key is None or base64.b64encode(key.raw).decode() != signed.get("public_key"):
        raise SignatureError(
            f"{where} is signed by key {signed.get('key_id')} ({signed.get('signer') or 'unnamed'}), which is not "
            f"trusted; add its .pub file to {trusted_keys_dir()} or pass --pubkey"
        )
    try:
        raw_signature = base64.b64decode(str(signed.get("signature")), validate=True)
        Ed25519PublicKey.from_public_bytes(key.raw).verify(raw_signature, canonical_json(stmt))
    except (InvalidSignature, binascii.Error, ValueError):
        raise SignatureError(
            f"{where}: the signature does not verify (the signature or what it signs was altered)"
        ) from None
    return stmt, key


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIG_SUFFIX)


def find_signature(path: Path, header: dict[str, Any]) -> Any | None:
    """The signature object of a model file: embedded in its header, else its `.sig` sidecar, else None."""
    if "signature" in header:
        return header["signature"]
    sig = sidecar(path)
    if not sig.exists():
        return None
    try:
        return json.loads(sig.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SignatureError(f"{sig} cannot be read as a signature ({exc})") from None


def write_sidecar(path: Path, signed: dict[str, Any]) -> Path:
    target = sidecar(path)
    with atomic_write(target, "w", encoding="utf-8") as f:
        f.write(json.dumps(signed, indent=1, sort_keys=True) + "\n")
    return target
