"""`base pull`: resolve a hub reference, download what the model needs, convert it to `.base`, store it.

A reference is `org/name[:tag]`. For a safetensors repo the tag is a quant scheme (`q4`), a
built-in profile (`mixed`) or both (`mixed-q4`); the default is `q4` with the default profile.
For a GGUF repo the tag picks the `.gguf` file by its quant (`Q4_0`, `q8_0`, `Q4_K_M`); its
quantized tensors are kept exactly as they are (Q4_0/Q4_1/Q8_0 already are MLX affine groups
of 32) unless a `quant` is asked for, which re-quantizes everything from dequantized floats.

The whole pull of one model runs under the store's lock for that model: downloads resume
from `.part` files left by an interrupted pull, the `.base` file is written under a temp name,
and the model appears in the store only once it is complete (see `store/registry.py`).
Downloaded sources are removed after a successful pull unless `keep_download`.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from baselm.store.errors import ProfileError, StoreError
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
# GGUF tensor types that mx.load keeps as MLX affine triplets, and the .base scheme they become.
_GGUF_SCHEMES = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "F16": "f16", "BF16": "bf16", "F32": "f32"}


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
        converted = convert(source_path, pending.temp_path, plan.quant, plan.group_size, plan.profile, source, supported)
        stored = pending.commit(arch=converted.arch, params=converted.params, quant=converted.quant, source=source)
        if not keep_download:
            shutil.rmtree(downloads, ignore_errors=True)
            _remove_empty_dir(downloads.parent)
    return stored


def wait_note(name: str) -> None:
    """What a pull prints when another process is pulling the same model."""
    print(f"waiting for another pull of {name} to finish", file=sys.stderr, flush=True)


def plan_variant(selection: Selection, tag: str | None, quant: str | None, profile: str | None,
                 group_size: int | None) -> Plan:
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


def _download(client: HubClient, snapshot: RepoSnapshot, selection: Selection, folder: Path,
              supported: Iterable[str] | None, progress: Progress) -> Path:
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
    """Writes `source` (an HF model folder or a .gguf file) as the `.base` file `target`.

    `quant` None keeps a GGUF's own quantization (an HF folder always gets one: q4 by default).
    """
    from baselm.store.base_file import write_base_file

    if source.is_dir():
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
        source=source_info or {"format": "safetensors" if source.is_dir() else "gguf", "path": str(source)},
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
    rules = tuple(Rule(r.pattern, r.scheme, r.group_size or group_size, r.is_regex) if _quantizes(r) else r
                  for r in profile.rules)
    return QuantProfile(f"{profile.name}-g{group_size}", rules)


def _quantizes(rule: Any) -> bool:
    from baselm.store.quantize import SCHEMES

    scheme = SCHEMES.get(rule.scheme)
    return scheme is not None and scheme.is_quantized


def _hf_source(folder: Path, quant: str, group_size: int | None, profile_name: str) -> tuple:
    from baselm.store import hf
    from baselm.store.quantize import quantize_tensors

    config = hf.read_config(folder)
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


def _gguf_source(path: Path, quant: str | None, group_size: int | None, profile_name: str) -> tuple:
    from baselm.store import gguf

    tensors, metadata = gguf.read_metadata(path)
    config = gguf.hf_config(metadata, set(tensors))
    weights = gguf.hf_tensors(tensors, config)
    del tensors
    # The GGUF's own tokenizer keys, as `Tokenizer.from_gguf_metadata` reads them.
    tokenizer = {
        "gguf": {k: v for k, v in metadata.items() if k.startswith("tokenizer.")},
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    tag = gguf_tag(path.name).upper()
    if quant is None:
        scheme = _GGUF_SCHEMES.get(tag)
        if scheme is None:
            raise StoreError(f"{path.name}: base keeps only {', '.join(_GGUF_SCHEMES)} GGUF files as they are; pass a quantization to convert it")
        return config["model_type"], config, tokenizer, _gguf_records(weights), (scheme, f"gguf-{tag}")
    from baselm.store.quantize import quantize_tensors

    profile = _profile(profile_name, quant, group_size)
    tensors = quantize_tensors(_gguf_floats(weights), profile)
    return config["model_type"], config, tokenizer, tensors, (quant, profile.to_json())


def _gguf_tensors(weights: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, float array or (codes, scales, biases) triplet) per logical tensor, sorted by name."""
    for name in sorted(weights):
        prefix = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")):
            continue
        if f"{prefix}.scales" in weights:
            yield name, tuple(weights[f"{prefix}.{k}"] for k in ("weight", "scales", "biases"))
        else:
            yield name, weights[name]


def _gguf_records(weights: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """GGUF tensors as `.base` records, the quantized ones bit for bit (groups of 32)."""
    from baselm.store.base_file import TensorRecord
    from baselm.store.gguf import GGUF_GROUP_SIZE

    for name, value in _gguf_tensors(weights):
        if isinstance(value, tuple):
            yield name, TensorRecord.from_triplet(*value, group_size=GGUF_GROUP_SIZE)
        else:
            yield name, TensorRecord.from_array(value)


def _gguf_floats(weights: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """GGUF tensors as float arrays, quantized ones dequantized (for re-quantization)."""
    import mlx.core as mx

    from baselm.store.gguf import GGUF_GROUP_SIZE

    for name, value in _gguf_tensors(weights):
        if isinstance(value, tuple):
            codes, scales, biases = value
            bits = codes.shape[1] * 32 // (scales.shape[1] * GGUF_GROUP_SIZE)
            value = mx.dequantize(codes, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits).astype(mx.float32)
        yield name, value
