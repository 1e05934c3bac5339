"""`base pull`: bring a model into the store as a `.base` file, from the hub or from a local path.

A hub reference is `org/name[:tag]`. For a safetensors repo the tag is a quant scheme (`q4`), a
built-in profile (`mixed`) or both (`mixed-q4`); the default is `q4` with the default profile.
For a GGUF repo the tag picks the `.gguf` file by its quant (`Q4_0`, `q8_0`, `Q4_K_M`).

A local path (`import_local`) is an HF folder, an MLX quantized folder, a `.gguf` or a `.base`
file, stored as `local/<name>` (or `--name org/name`).

An already-quantized source keeps its own quantization unless a `quant` is asked for: GGUF
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks and MLX triplets are carried over exactly (see
`store/gguf_quants.py`, `store/mlx_folder.py`); GGUF K-quants have no exact `.base` form and are
re-quantized at their own bit width. Every re-quantization of quantized weights logs one line
saying that it compounds error.

The whole pull of one model runs under the store's lock for that model: downloads resume
from `.part` files left by an interrupted pull, the `.base` file is written under a temp name,
and the model appears in the store only once it is complete (see `store/registry.py`).
Downloaded sources are removed after a successful pull unless `keep_download`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselm.store.errors import ProfileError, StoreError, UnsupportedModelError
from baselm.store.hub import (
    HubClient,
    Progress,
    RepoSnapshot,
    Selection,
    check_model_type,
    default_progress,
    gguf_tag,
    select_files,
)
from baselm.store.registry import Store, StoredModel, check_model_name, split_ref

DEFAULT_QUANT = "q4"
DEFAULT_PROFILE = "default"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a pull stores: the variant name and how to quantize (None: keep the source's)."""

    variant: str
    quant: str | None
    profile: str
    group_size: int | None


@dataclass(frozen=True, slots=True)
class Converted:
    arch: str
    params: int
    quant: str


def pull(
    ref: str,
    *,
    store: Store | None = None,
    quant: str | None = None,
    profile: str | None = None,
    group_size: int | None = None,
    revision: str = "main",
    supported: Iterable[str] | None = None,
    client: HubClient | None = None,
    progress: Progress | None = None,
    force: bool = False,
    keep_download: bool = False,
) -> StoredModel:
    """Pulls `org/name[:tag]` into the store and returns the stored model.

    `supported` (the model_types base can run) is checked against config.json before any
    weights are fetched; None skips the check. A variant already stored from the same commit
    is returned as it is unless `force`.
    """
    store = store or Store()
    repo, tag = split_ref(ref)
    check_model_name(repo)
    client = client or HubClient()
    progress = progress or default_progress()
    snapshot = client.snapshot(repo, revision)
    repo = snapshot.repo
    selection = select_files(snapshot, tag)
    plan = plan_variant(selection, tag, quant, profile, group_size)
    with store.begin_write(repo, plan.variant, on_wait=lambda: wait_note(repo)) as pending:
        existing = pending.existing
        if existing and existing.source.get("commit") == snapshot.commit and not force:
            return existing
        downloads = store.downloads_dir / repo
        _remove_other_commits(downloads, snapshot.commit)
        store.check_free_space(2 * selection.num_bytes)  # the download, and at most as much again for the .base
        source_path = _download(client, snapshot, selection, downloads / snapshot.commit, supported, progress)
        source = _source_info(snapshot, selection)
        converted = convert(
            source_path, pending.temp_path, plan.quant, plan.group_size, plan.profile, source, supported
        )
        stored = pending.commit(arch=converted.arch, params=converted.params, quant=converted.quant, source=source)
        if not keep_download:
            shutil.rmtree(downloads, ignore_errors=True)
            _remove_empty_dir(downloads.parent)
    return stored


def wait_note(name: str) -> None:
    """What a pull prints when another process is pulling the same model."""
    print(f"waiting for another pull of {name} to finish", file=sys.stderr, flush=True)


def plan_variant(
    selection: Selection, tag: str | None, quant: str | None, profile: str | None, group_size: int | None
) -> Plan:
    """The variant name and quantization a tag and options ask for."""
    from baselm.store.quantize import BUILTIN_PROFILES, SCHEMES

    if quant is not None and quant not in SCHEMES:
        raise StoreError(f"unknown quantization {quant!r}; choose one of {', '.join(SCHEMES)}")
    if selection.kind == "gguf":  # the file's own quant, or re-quantized to `quant`
        base = (selection.gguf_tag or "gguf").lower()
        profile = profile or DEFAULT_PROFILE
        variant = f"{base}-{_variant_name(profile, quant, group_size)}" if quant else base
        return Plan(variant, quant, profile, group_size)
    tag_profile, tag_quant = _parse_tag(tag, BUILTIN_PROFILES, SCHEMES)
    quant = quant or tag_quant or DEFAULT_QUANT
    profile = profile or tag_profile or DEFAULT_PROFILE
    return Plan(_variant_name(profile, quant, group_size), quant, profile, group_size)


def _variant_name(profile: str, quant: str, group_size: int | None) -> str:
    """`q4`, `mixed-q4`, `myprofile-q4-g32` (a profile file is named by its stem)."""
    from baselm.store.quantize import BUILTIN_PROFILES

    name = profile if profile in BUILTIN_PROFILES else Path(profile).stem
    variant = quant if name == DEFAULT_PROFILE else f"{name}-{quant}"
    return variant if group_size is None else f"{variant}-g{group_size}"


def _parse_tag(tag: str | None, profiles: Iterable[str], schemes: Iterable[str]) -> tuple[str | None, str | None]:
    """(profile, scheme) named by a safetensors tag: `q4`, `mixed` or `mixed-q4`."""
    if tag is None:
        return None, None
    tag = tag.lower()
    if tag in schemes:
        return None, tag
    if tag in profiles:
        return tag, None
    head, _, tail = tag.rpartition("-")
    if head in profiles and tail in schemes:
        return head, tail
    raise StoreError(
        f"unknown variant {tag!r}; use a quantization ({', '.join(schemes)}), a profile ({', '.join(profiles)}) or profile-quant"
    )


# ---------------------------------------------------------------------------------------------
# Download


def _download(
    client: HubClient,
    snapshot: RepoSnapshot,
    selection: Selection,
    folder: Path,
    supported: Iterable[str] | None,
    progress: Progress,
) -> Path:
    """Fetches the selection into `folder`; returns the folder (safetensors) or the .gguf file."""
    if selection.kind == "gguf":
        return client.download(snapshot, selection.files[0], folder, progress)
    config_file = next(f for f in selection.files if f.path == "config.json")
    config_path = client.download(snapshot, config_file, folder, progress)
    if supported is not None:  # before any weights: an unsupported model costs one small file
        check_model_type(_read_json(config_path), supported, snapshot.repo)
    for file in selection.files:
        if file is not config_file:
            client.download(snapshot, file, folder, progress)
    return folder


def _remove_other_commits(downloads: Path, commit: str) -> None:
    """Partial downloads of other commits cannot be resumed any more."""
    if downloads.is_dir():
        for path in downloads.iterdir():
            if path.name != commit:
                shutil.rmtree(path, ignore_errors=True)


def _remove_empty_dir(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty: other models' downloads


def _source_info(snapshot: RepoSnapshot, selection: Selection) -> dict[str, Any]:
    info: dict[str, Any] = {
        "format": selection.kind,
        "repo": snapshot.repo,
        "revision": snapshot.revision,
        "commit": snapshot.commit,
        "files": [f.path for f in selection.files],
    }
    if selection.kind == "gguf":
        info["sha256"] = selection.files[0].sha256
    return info


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: not readable JSON ({exc})") from None


# ---------------------------------------------------------------------------------------------
# Conversion


def convert(
    source: Path,
    target: Path,
    quant: str | None,
    group_size: int | None,
    profile: str,
    source_info: dict[str, Any] | None = None,
    supported: Iterable[str] | None = None,
) -> Converted:
    """Writes `source` (an HF or MLX model folder, or a .gguf file) as the `.base` file `target`.

    `quant` None keeps an already-quantized source's own quantization (GGUF, MLX folder); an HF
    folder always gets one (q4 by default). Re-quantizing a quantized source logs that it
    compounds error.
    """
    from baselm.store.base_file import write_base_file
    from baselm.store.mlx_folder import is_mlx_folder

    if source.is_dir() and is_mlx_folder(_folder_config(source)):
        arch, config, tokenizer, tensors, label = _mlx_source(source, quant, group_size, profile)
    elif source.is_dir():
        arch, config, tokenizer, tensors, label = _hf_source(source, quant or DEFAULT_QUANT, group_size, profile)
    else:
        arch, config, tokenizer, tensors, label = _gguf_source(source, quant, group_size, profile)
    if supported is not None:
        check_model_type(config, supported, str(source_info.get("repo") if source_info else source))
    counter = _ParamCounter(tensors)
    write_base_file(
        target,
        counter,
        arch=arch,
        config=config,
        tokenizer=tokenizer,
        quant_scheme=label[0],
        quant_profile=label[1],
        source=source_info or {"format": source_format(source), "path": str(source)},
    )
    return Converted(arch, counter.params, label[0])


class _ParamCounter:
    """Passes (name, record) pairs through and counts the weights' logical elements."""

    def __init__(self, tensors: Iterator[tuple[str, Any]]) -> None:
        self.tensors, self.params = tensors, 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, record in self.tensors:
            self.params += math.prod(record.shape)
            yield name, record


def _profile(name: str, quant: str, group_size: int | None) -> Any:
    from baselm.store.quantize import QuantProfile, Rule, resolve_profile

    profile = resolve_profile(name, quant)
    if group_size is None:
        return profile
    if group_size not in (32, 64, 128):
        raise ProfileError(f"group size {group_size} must be 32, 64 or 128")
    rules = tuple(
        Rule(r.pattern, r.scheme, r.group_size or group_size, r.is_regex) if _quantizes(r) else r for r in profile.rules
    )
    return QuantProfile(f"{profile.name}-g{group_size}", rules)


def _quantizes(rule: Any) -> bool:
    from baselm.store.quantize import SCHEMES

    scheme = SCHEMES.get(rule.scheme)
    return scheme is not None and scheme.is_quantized


def _folder_config(folder: Path) -> dict[str, Any]:
    from baselm.store import hf

    return hf.read_config(folder)


def source_format(source: Path) -> str:
    """`safetensors` (HF folder), `mlx` (MLX quantized folder), `gguf` or `base`."""
    from baselm.store.mlx_folder import is_mlx_folder

    if source.is_dir():
        return "mlx" if is_mlx_folder(_folder_config(source)) else "safetensors"
    return "base" if source.suffix == ".base" else "gguf"


def _hf_source(folder: Path, quant: str, group_size: int | None, profile_name: str) -> tuple:
    from baselm.store import hf
    from baselm.store.quantize import quantize_tensors

    config = hf.read_config(folder)
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method:
        raise UnsupportedModelError(
            f"{folder}: its weights are {method}-quantized, which base cannot read; use the unquantized model"
        )
    weights = hf.read_weights(folder)
    profile = _profile(profile_name, quant, group_size)
    tensors = quantize_tensors(((n, weights[n]) for n in sorted(weights)), profile)
    return str(config.get("model_type")), config, hf_tokenizer(folder), tensors, (quant, profile.to_json())


def hf_tokenizer(folder: Path) -> dict[str, Any]:
    """The header's `tokenizer`: tokenizer.json as its text (for `Tokenizer.from_str`), the parsed
    tokenizer_config.json, and the chat template (chat_template.jinja/.json win over the config's)."""
    if not (folder / "tokenizer.json").is_file():
        raise StoreError(f"{folder}: no tokenizer.json; base needs the fast tokenizer file")
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template", template)
    return {
        "tokenizer.json": (folder / "tokenizer.json").read_text(encoding="utf-8"),
        "tokenizer_config.json": config,
        "chat_template": template,
    }


GGUF_GROUP = 32  # weights per scale in GGUF's legacy and K-quant blocks


def requantize_note(label: str, source_quant: str, quant: str) -> None:
    """The one line that says a quantized source is being rounded a second time."""
    log.warning("%s: requantizing its %s weights to %s compounds the two rounding errors", label, source_quant, quant)


def _record_values(record: Any) -> Any:
    """A `.base` record as MLX float values: float records as stored, quantized ones dequantized in f32."""
    import mlx.core as mx

    if record.bits is None:
        values = mx.array(record.data)
        return values.view(mx.bfloat16) if record.dtype == "bf16" else values
    scales = mx.array(record.scales)
    biases = mx.array(record.biases)
    if record.scale_dtype == "bf16":
        scales, biases = scales.view(mx.bfloat16), biases.view(mx.bfloat16)
    return mx.dequantize(
        mx.array(record.codes),
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=record.group_size,
        bits=record.bits,
    )  # (out, in) float32


# ---------------------------------------------------------------------------------------------
# GGUF sources


# The .base scheme a GGUF tensor type is kept as (K-quants: re-quantized at that width).
_GGUF_SCHEMES = {
    "Q4_0": "q4",
    "Q4_1": "q4",
    "Q5_0": "q5",
    "Q5_1": "q5",
    "Q8_0": "q8",
    "Q2_K": "q2",
    "Q3_K": "q3",
    "Q4_K": "q4",
    "Q5_K": "q5",
    "Q6_K": "q6",
    "F16": "f16",
    "BF16": "bf16",
    "F32": "f32",
}


def gguf_body_type(gguf_file: Any) -> str:
    """The tensor type holding most of a GGUF's matrix weights (e.g. Q4_1 beside a Q8_0 embedding)."""
    counts: dict[str, int] = {}
    for info in gguf_file.tensors.values():
        if len(info.shape) >= 2:
            counts[info.type_name] = counts.get(info.type_name, 0) + info.num_params
    return max(sorted(counts), key=counts.get) if counts else "F32"


def gguf_tokenizer(metadata: dict[str, Any]) -> dict[str, Any]:
    """The header's `tokenizer` for a GGUF: its own tokenizer keys, as `Tokenizer.from_gguf_metadata` reads them."""
    return {
        "gguf": {k: v for k, v in metadata.items() if k.startswith("tokenizer.")},
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def _gguf_source(path: Path, quant: str | None, group_size: int | None, profile_name: str) -> tuple:
    from baselm.store import gguf

    gguf_file = gguf.GGUFFile.open(path)
    gguf_file.check_types()
    config = gguf.hf_config(gguf_file.metadata, set(gguf_file.tensors))
    tokenizer = gguf_tokenizer(gguf_file.metadata)
    records = gguf.hf_records(gguf_file, config)
    body = gguf_body_type(gguf_file)
    if quant is None:
        tag = gguf_tag(path.name).upper() or body
        return (
            config["model_type"],
            config,
            tokenizer,
            _kept_gguf(path.name, gguf_file, records),
            (_GGUF_SCHEMES[body], f"gguf-{tag}"),
        )
    is_quantized = any(info.type_name not in ("F32", "F16", "BF16") for info in gguf_file.tensors.values())
    if is_quantized and quant not in ("f32", "f16", "bf16"):
        requantize_note(path.name, body, quant)
        # GGUF quants scale groups of 32 weights; new groups that match them cost far less than
        # wider ones, which straddle two source scales (SmolLM2 Q4_1 -> q4 perplexity:
        # +0.14% with groups of 32, +33.7% with 64; see the README's table).
        group_size = group_size or GGUF_GROUP
    profile = _profile(profile_name, quant, group_size)
    return config["model_type"], config, tokenizer, _requantized_gguf(records, profile), (quant, profile.to_json())


def _kept_gguf(label: str, gguf_file: Any, records: Iterator[tuple[str, str, Any]]) -> Iterator[tuple[str, Any]]:
    """GGUF tensors as `.base` records: float and legacy-quant ones exactly, K-quants at their own width."""
    from baselm.store.gguf_quants import K_TYPES
    from baselm.store.quantize import QuantProfile, Rule, quantize_tensor

    k_types = sorted({i.type_name for i in gguf_file.tensors.values() if i.type_name in K_TYPES})
    if k_types:
        widths = ", ".join(f"{t} -> {K_TYPES[t]}" for t in k_types)
        log.warning(
            "%s: K-quant tensors have no exact .base form; requantizing them (%s) compounds the two rounding errors",
            label,
            widths,
        )
    for name, type_name, value in records:
        if type_name in K_TYPES:
            scheme = K_TYPES[type_name]
            value, _ = quantize_tensor(name, value, QuantProfile(f"gguf-{type_name}", (Rule("*", scheme),)))
        yield name, value


def _requantized_gguf(records: Iterator[tuple[str, str, Any]], profile: Any) -> Iterator[tuple[str, Any]]:
    """GGUF tensors stored as `profile` decides. A quantized block bound for at least as many
    bits in groups of the same size is widened exactly (Q4_1 asked for as q5, q6 or q8 keeps
    its values); everything else is dequantized and quantized anew."""
    import numpy as np

    from baselm.store.quantize import quantize_tensor, widen

    for name, _, value in records:
        if not isinstance(value, np.ndarray) and value.bits is not None:
            decision = profile.decide(name, value.shape, "f32")
            if decision.is_quantized:
                exact = widen(value, int(decision.dtype.removeprefix("base_q")), decision.group_size)
                if exact is not None:
                    yield name, exact
                    continue
        array = value if isinstance(value, np.ndarray) else _record_values(value)
        yield name, quantize_tensor(name, array, profile)[0]


# ---------------------------------------------------------------------------------------------
# MLX sources


def _mlx_source(folder: Path, quant: str | None, group_size: int | None, profile_name: str) -> tuple:
    from baselm.store import mlx_folder

    config = _folder_config(folder)
    mlx_folder.check_quantization(folder, config)
    bits = mlx_folder.default_bits(config)
    plain = mlx_folder.plain_config(config)
    records = mlx_folder.mlx_records(folder, config)
    if quant is None:
        return str(plain.get("model_type")), plain, hf_tokenizer(folder), records, (f"q{bits}", f"mlx-q{bits}")
    from baselm.store.quantize import quantize_tensors

    requantize_note(folder.name, f"MLX q{bits}", quant)
    profile = _profile(profile_name, quant, group_size)
    tensors = quantize_tensors(((name, _record_values(record)) for name, record in records), profile)
    return str(plain.get("model_type")), plain, hf_tokenizer(folder), tensors, (quant, profile.to_json())


# ---------------------------------------------------------------------------------------------
# Local sources: `base pull ./folder`, `base pull model.gguf`, `base pull model.base`


LOCAL_ORG = "local"


@dataclass(frozen=True, slots=True)
class LocalSource:
    """What a local path holds: its format, the name it is stored under by default, and its own variant."""

    path: Path
    format: str  # safetensors | mlx | gguf | base
    default_name: str
    own_variant: str | None  # the variant a quantized source keeps when no quant is asked (None: HF folder)


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
) -> StoredModel:
    """Stores a local model (HF folder, MLX folder, `.gguf` or `.base` file) as `local/<name>:<variant>`.

    The name defaults to the folder's or file's name (`--name org/name` overrides); the variant is
    the quantization asked for, or the source's own when it is already quantized and none is asked
    (GGUF `q4_1`, MLX `mlx-q4`, a `.base` file's). A `.base` file is verified and copied as it is.
    The write is atomic and locked as a hub pull's is. A variant already stored from the same
    bytes (sha256) is returned as it is unless `force`; one from other bytes needs `force`.
    """
    from baselm.store.quantize import SCHEMES

    store = store or Store()
    if quant is not None and quant not in SCHEMES:
        raise StoreError(f"unknown quantization {quant!r}; choose one of {', '.join(SCHEMES)}")
    local = inspect_local(Path(path).expanduser().resolve())
    variant = _local_variant(local, quant, profile, group_size)
    model_name = _local_name(name, local.default_name)
    digest = source_sha256(local.path)
    source = {"format": local.format, "path": str(local.path), "sha256": digest}
    with store.begin_write(model_name, variant, on_wait=lambda: wait_note(model_name)) as pending:
        existing = pending.existing
        if existing and not force:
            if existing.source.get("sha256") == digest:
                return existing
            raise StoreError(
                f"{existing.ref} is already stored from {existing.source.get('path') or 'another source'}; pass --force to replace it"
            )
        store.check_free_space(_num_bytes(local.path))
        if local.format == "base":
            return _import_base(local.path, pending, source, supported)
        converted = convert(
            local.path, pending.temp_path, quant, group_size, profile or DEFAULT_PROFILE, source, supported
        )
        return pending.commit(arch=converted.arch, params=converted.params, quant=converted.quant, source=source)


def inspect_local(path: Path) -> LocalSource:
    """The format, default name and own variant of a local model path, or a clear error."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StoreError(f"{path}: a model folder needs a config.json (an HF or MLX model folder)")
        from baselm.store.mlx_folder import default_bits, is_mlx_folder

        config = _folder_config(path)
        if is_mlx_folder(config):
            return LocalSource(path, "mlx", path.name, f"mlx-q{default_bits(config)}")
        return LocalSource(path, "safetensors", path.name, None)
    if path.suffix == ".gguf":
        from baselm.store import gguf

        gguf_file = gguf.GGUFFile.open(path)
        tag = gguf_tag(path.name)
        stem = path.name.removesuffix(".gguf")
        stem = stem[: -len(tag) - 1] if tag else stem
        return LocalSource(
            path, "gguf", _gguf_name(stem, gguf_file.metadata), (tag or gguf_body_type(gguf_file)).lower()
        )
    if path.suffix == ".base":
        from baselm.store.base_file import BaseFile

        header = BaseFile.open(path).header
        return LocalSource(path, "base", path.stem, _base_variant(header))
    raise StoreError(f"{path}: not a model; give an HF or MLX model folder, a .gguf file or a .base file")


def _gguf_name(stem: str, metadata: dict[str, Any]) -> str:
    """The file's name without its quant tag; the metadata's names when the file name says nothing."""
    parts = [metadata.get("general.basename"), metadata.get("general.size_label")]
    candidates = [
        stem,
        "-".join(str(p) for p in parts if p) if parts[0] else "",
        metadata.get("general.name") or "",
        "model",
    ]
    return next(n for n in (_clean_name(str(c)) for c in candidates) if n)


def _clean_name(text: str) -> str:
    """A string as a store name part: letters, digits, '.', '_', '-' (other runs become '-')."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text)
    return re.sub(r"\.{2,}", ".", text).strip("-._")


def _local_name(name: str | None, default: str) -> str:
    """`org/name` as given, `name` alone under `local/`, or the source's own name under `local/`."""
    if name is None:
        full = f"{LOCAL_ORG}/{_clean_name(default) or 'model'}"
    else:
        full = name if "/" in name else f"{LOCAL_ORG}/{name}"
    check_model_name(full)
    return full


def _local_variant(local: LocalSource, quant: str | None, profile: str | None, group_size: int | None) -> str:
    if local.format == "base" and (quant or profile or group_size):
        raise StoreError(
            f"{local.path.name}: a .base file is stored as it is; --quant, --profile and --group-size do not apply"
        )
    if quant is None and local.own_variant is not None:
        if profile or group_size:
            raise StoreError(
                f"{local.path.name} is already quantized; --profile and --group-size apply only with --quant (which requantizes it)"
            )
        return local.own_variant
    return _variant_name(profile or DEFAULT_PROFILE, quant or DEFAULT_QUANT, group_size)


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


def _import_base(path: Path, pending: Any, source: dict[str, Any], supported: Iterable[str] | None) -> StoredModel:
    """Verifies a `.base` file (layout and every checksum) and copies it into the store as it is."""
    from baselm.store.base_file import BaseFile

    base = BaseFile.open(path)
    base.verify()
    if supported is not None:
        check_model_type(base.header["config"], supported, str(path))
    shutil.copyfile(path, pending.temp_path)
    params = sum(entry.num_params for entry in base.tensors.values())
    return pending.commit(arch=base.header["arch"], params=params, quant=base.header["quant_scheme"], source=source)


def source_sha256(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(8 * 1024 * 1024):
                digest.update(chunk)
    return digest.hexdigest()


def _num_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
