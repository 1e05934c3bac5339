"""`base pull ./folder`, `base pull model.gguf`, `base pull model.base`: a local model into the store.

A local path is an HF folder, an MLX quantized folder, a `.gguf` or a `.base` file, stored under
the name it gives itself (a GGUF's `general.organization` and `general.basename`, `size_label`,
`finetune`; an HF config's `_name_or_path`; a `.base` file's source repo), else `local/<its file
name>`, or `--name org/name`. Its variant is the quantization asked for, or the
source's own when it is already quantized and none is asked (GGUF `q4_1`, MLX `mlx-q4`, a
`.base` file's). A `.base` file is verified and copied as it is; the rest are converted (see
`convert.py`). The write is atomic and locked as a hub pull's is (see `registry.py`). A GGUF
model takes the vision projector (`mmproj*.gguf`) its folder holds, or the one `--mmproj` names,
or none with `--no-mmproj`, into the same `.base` file.

The same source (sha256) asked for as the same variant is converted once: without `--name` the
stored model is returned, with one the new name points at the stored file.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from baselm.store import gguf, gguf_split, hf
from baselm.store.base_header import check_header_checksum
from baselm.store.base_reader import BaseFile
from baselm.store.blobs import file_sha256
from baselm.store.convert import convert
from baselm.store.convert_gguf import gguf_body_type
from baselm.store.errors import StoreError
from baselm.store.hub import DEFAULT_MMPROJ, MmprojChoice, check_model_type, gguf_tag
from baselm.store.mlx_folder import default_bits, is_mlx_folder
from baselm.store.progress import NoProgress, Progress
from baselm.store.pull import wait_note
from baselm.store.registry import LOCAL_ORG, PendingWrite, Store, StoredModel, check_model_name, qualify_name
from baselm.store.signed_file import verify_file
from baselm.store.signing import find_signature
from baselm.store.variants import DEFAULT_PROFILE, DEFAULT_QUANT, check_quant, variant_name


@dataclass(frozen=True, slots=True)
class LocalSource:
    """What a local path holds: its format, the name it is stored under by default, and its own variant."""

    path: Path
    format: str  # safetensors | mlx | gguf | base
    default_name: str  # org/name
    own_variant: str | None  # the variant a quantized source keeps when no quant is asked (None: HF folder)
    mmproj: Path | None = None  # a GGUF model's vision projector, from the folder that holds both

    @property
    def files(self) -> list[Path]:
        """Every file the source reads, in name order within each part (see `_source_files`)."""
        return _source_files(self.path) + ([self.mmproj] if self.mmproj is not None else [])

    def source_info(self, digest: str) -> dict[str, Any]:
        """What the store records of where the model came from (its files' `digest`: `source_sha256`)."""
        info = {"format": self.format, "path": str(self.path), "sha256": digest}
        return info if self.mmproj is None else {**info, "mmproj": str(self.mmproj)}


def import_local(
    path: Path,
    *,
    name: str | None = None,
    quant: str | None = None,
    group_size: int | None = None,
    profile: str | None = None,
    supported: Iterable[str] | None,
    force: bool = False,
    store: Store | None = None,
    progress: Progress | None = None,
    mmproj: MmprojChoice = DEFAULT_MMPROJ,
) -> StoredModel:
    """Stores a local model (HF folder, MLX folder, `.gguf` or `.base` file) as `org/name:variant`.

    The name defaults to the one the source gives itself (`--name org/name` overrides); the variant is
    the quantization asked for, or the source's own when it is already quantized and none is asked
    (GGUF `q4_1`, MLX `mlx-q4`, a `.base` file's). A `.base` file is verified and copied as it is.
    The write is atomic and locked as a hub pull's is. A variant already stored from the same
    bytes (sha256) is returned as it is unless `force`; one from other bytes needs `force`. The
    same bytes stored under another name are not converted again (see the module docstring). `progress`
    hears of each tensor converted, or of a signed `.base` file's bytes; `mmproj`: see `inspect_local`.
    """
    store = store or Store()
    check_quant(quant)
    local = inspect_local(Path(path).expanduser().resolve(), mmproj)
    variant = _local_variant(local, quant, profile, group_size)
    digest = source_sha256(local.path, local.files)
    source = local.source_info(digest)
    same = None if force else store.find_source(digest, variant)
    if same is not None and name is None:  # the name the source gives itself, if that is one of the stored
        own = store.get(local.default_name, variant)
        return own if own is not None and own.source.get("sha256") == digest else same
    model_name = local.default_name if name is None else qualify_name(name)
    with store.begin_write(model_name, variant, on_wait=lambda: wait_note(model_name)) as pending:
        existing = pending.existing
        if existing and not force:
            if existing.source.get("sha256") == digest:
                return existing
            raise StoreError(
                f"{existing.ref} is already stored from {existing.source.get('path') or 'another source'}; pass "
                "--force to replace it"
            )
        if same is not None:
            return pending.link(same, source)
        store.check_free_space(sum(p.stat().st_size for p in local.files))
        if local.format == "base":
            return _import_base(local.path, pending, source, supported, progress or NoProgress())
        converted = convert(
            local.path,
            pending.temp_path,
            quant,
            group_size,
            profile or DEFAULT_PROFILE,
            source,
            supported,
            progress,
            mmproj=local.mmproj,
        )
        return converted.commit(pending, source)


def inspect_local(path: Path, mmproj: MmprojChoice = DEFAULT_MMPROJ) -> LocalSource:
    """The format, default name and own variant of a local model path, or a clear error; a GGUF
    model's vision projector is the file `mmproj` names, else the one its folder holds, if wanted."""
    local = _inspect(path)
    if mmproj.name is not None:
        projector = Path(mmproj.name).expanduser().resolve()
        if local.format != "gguf":
            raise StoreError(f"--mmproj goes with a .gguf language model, not {path.name}")
        if not projector.is_file():
            raise StoreError(f"--mmproj {mmproj.name}: no such file")
        return replace(local, mmproj=projector)
    if mmproj.wanted and path.is_dir() and local.format == "gguf":
        return replace(local, mmproj=gguf_split.mmproj_in(path))
    return local


def _inspect(path: Path) -> LocalSource:
    if path.is_dir():
        if not (path / "config.json").is_file():
            first = gguf_split.first_part_in(path)  # a folder of one GGUF model: a file, or a split's parts
            if first is None:
                raise StoreError(f"{path}: a model folder needs a config.json (an HF or MLX model folder) or a GGUF")
            return _inspect(first)
        config = hf.read_config(path)
        name = _repo_name(config.get("_name_or_path"), path.name)
        if is_mlx_folder(config):
            return LocalSource(path, "mlx", name, f"mlx-q{default_bits(config)}")
        return LocalSource(path, "safetensors", name, None)
    if path.suffix == ".gguf":
        gguf_file = gguf.GGUFFile.open(path)
        split_stem = gguf_split.split_stem(path.name)  # `NAME` of `NAME-00001-of-00003.gguf`
        file_name = f"{split_stem}.gguf" if split_stem else path.name
        tag = gguf_tag(file_name)
        stem = file_name.removesuffix(".gguf")
        stem = stem[: -len(tag) - 1] if tag else stem
        return LocalSource(
            path, "gguf", _gguf_name(stem, gguf_file.metadata), (tag or gguf_body_type(gguf_file)).lower()
        )
    if path.suffix == ".base":
        header = BaseFile.open(path).header
        repo = header.get("source", {}).get("repo") if isinstance(header.get("source"), dict) else None
        return LocalSource(path, "base", _repo_name(repo, path.stem), _base_variant(header))
    raise StoreError(f"{path}: not a model; give an HF or MLX model folder, a .gguf file or a .base file")


def _gguf_name(stem: str, metadata: dict[str, Any]) -> str:
    """`org/name` from a GGUF's own metadata: the organization (else the author, else `local`) and
    basename-size_label-finetune (else `general.name`, else the file name without its quant tag)."""
    org = _clean_name(str(metadata.get("general.organization") or metadata.get("general.author") or ""))
    parts = [metadata.get(f"general.{key}") for key in ("basename", "size_label", "finetune")]
    candidates = ["-".join(str(p) for p in parts if p) if parts[0] else "", metadata.get("general.name") or "", stem]
    name = next((n for n in (_clean_name(str(c)) for c in candidates) if n), "model")
    return f"{org or LOCAL_ORG}/{name}"


def _repo_name(repo: Any, fallback: str) -> str:
    """`repo` when it is an `org/name` the store takes (an HF config's `_name_or_path`, a `.base`
    file's source repo), else `local/<fallback>`."""
    if isinstance(repo, str) and repo.count("/") == 1 and not repo.startswith((".", "/", "~")):
        try:
            check_model_name(repo)
            return repo
        except StoreError:
            pass
    return f"{LOCAL_ORG}/{_clean_name(fallback) or 'model'}"


def _clean_name(text: str) -> str:
    """A string as a store name part: letters, digits, '.', '_', '-' (other runs become '-')."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text)
    return re.sub(r"\.{2,}", ".", text).strip("-._")


def _local_variant(local: LocalSource, quant: str | None, profile: str | None, group_size: int | None) -> str:
    if local.format == "base" and (quant or profile or group_size):
        raise StoreError(
            f"{local.path.name}: a .base file is stored as it is; --quant, --profile and --group-size do not apply"
        )
    if quant is None and local.own_variant is not None:
        if profile or group_size:
            raise StoreError(
                f"{local.path.name} is already quantized; --profile and --group-size apply only with --quant (which "
                "requantizes it)"
            )
        return local.own_variant
    return variant_name(profile or DEFAULT_PROFILE, quant or DEFAULT_QUANT, group_size)


def _base_variant(header: dict[str, Any]) -> str:
    """A `.base` file's variant from its header: `q4` (default profile), `mixed-q4`, `q4_1` (a kept GGUF)."""
    profile = header.get("quant_profile")
    name = profile.get("name") if isinstance(profile, dict) else profile
    scheme = str(header.get("quant_scheme") or "base")
    if not isinstance(name, str) or not name:
        return _clean_name(scheme.lower()) or "base"
    if name.startswith("gguf-"):
        return _clean_name(name.removeprefix("gguf-").lower())
    return _clean_name(name.removeprefix(f"{DEFAULT_PROFILE}-")) or scheme


def _import_base(
    path: Path,
    pending: PendingWrite,
    source: dict[str, Any],
    supported: Iterable[str] | None,
    progress: Progress | None,
) -> StoredModel:
    """Verifies a `.base` file (layout, every checksum, and its signature when it has one: a bad or
    untrusted signature stores nothing) and copies it into the store as it is, its `.sig` beside it."""
    base = BaseFile.open(path)
    signed = find_signature(path, base.header)
    if signed is None:
        base.verify()
    else:
        check_header_checksum(path, base.header)
        verify_file(path, progress=progress)
    if supported is not None:
        check_model_type(base.header["config"], supported, str(path))
    shutil.copyfile(path, pending.temp_path)
    params = sum(entry.num_params for entry in base.tensors.values())
    detached = signed if signed is not None and "signature" not in base.header else None
    return pending.commit(
        arch=base.header["arch"],
        params=params,
        quant=base.header["quant_scheme"],
        source=source,
        signature=detached,
    )


def source_sha256(path: Path, files: list[Path] | None = None) -> str:
    """sha256 of a file, of a split GGUF's parts (and a vision projector with it: `files`), or of a
    folder's files (relative names and contents, in name order)."""
    files = _source_files(path) if files is None else files
    if not path.is_dir() and len(files) == 1:
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in files:
        name = file.relative_to(path) if path.is_dir() else file.name  # a projector may lie elsewhere
        digest.update(str(name).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(8 * 1024 * 1024):
                digest.update(chunk)
    return digest.hexdigest()


def _source_files(path: Path) -> list[Path]:
    """A folder's files in name order, a split GGUF's parts, or the file alone."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return gguf_split.part_paths(path) if path.suffix == ".gguf" else [path]
