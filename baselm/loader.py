"""Turns a model reference into a runnable model.

A reference is a store name (`org/name[:variant]` or a short alias), a `.base` file, an HF
model folder (config.json + safetensors), or a `.gguf` file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from baselm import gguf_blocks
from baselm.adapters import Adapter, AdapterError, apply_adapters
from baselm.backend import Backend
from baselm.memory import release_freed_memory
from baselm.models import build_model
from baselm.models.base import DecoderModel, ModelConfigError
from baselm.store import hf
from baselm.store.base_reader import BaseFile, model_weights
from baselm.store.errors import BaseFileError, ModelFileError, SignatureError
from baselm.store.gguf_arch import ROPE_FREQS
from baselm.store.gguf_split import first_part_in, mmproj_in
from baselm.store.model_card import context_length
from baselm.store.registry import Store
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.tokenizer.vocab_cache import default_cache_dir

if TYPE_CHECKING:
    from baselm.served_adapters import AdapterSpec, ServedAdapters


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: weights on the device, its tokenizer and generation settings."""

    name: str
    path: Path
    model: DecoderModel
    tokenizer: Tokenizer
    config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    backend: Backend
    adapters: tuple[Adapter, ...] = ()  # the LoRA adapters in its weights (its K/V differ from the file's)
    served_adapters: ServedAdapters | None = None  # the LoRA adapters requests choose (baselm/served_adapters.py)

    @property
    def max_model_len(self) -> int:
        return context_length(self.config)

    def check_writes_text(self, name: str | None = None) -> None:
        """NOTE: the one rule that a classifier writes no text: its logits are its head's labels, not
        the vocabulary's, so generating from it would only spell label numbers as tokens."""
        if self.model.is_classifier:
            raise ModelConfigError(
                f"{name or self.name} is a reranker with a classification head: it ranks documents "
                "(POST /v1/rerank on `base serve`) and writes no text"
            )


def _eos_ids(config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [i for i in tokenizer.eos_token_ids if i not in ids]
    return tuple(ids)


def model_from_checkpoint(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    backend: Backend,
    group_size: int | None = None,
    shard: Any = None,
    adapters: Sequence[Adapter] = (),
) -> DecoderModel:
    """`build_model` over a checkpoint's tensors (HF names), with `adapters` (LoRA) added to them
    first. GGUF's `rope_freqs` tensor (llama 3 scaling as per-frequency divisors, also kept by `.base`
    files converted from GGUF) has no HF name: it goes to the model's RoPE, not among its weights."""
    factors = weights.pop(ROPE_FREQS, None)
    if any(gguf_blocks.split_name(name) for name in weights):  # a GGUF's or a `.base` pulled from one
        from baselm.store.gguf_affine import blocks_as_triplets  # deltas and slices take affine triplets

        blocks_as_triplets(weights, keep=kept_block_types(backend, shard, adapters))
    if adapters:
        apply_adapters(weights, list(adapters), config)
    release_freed_memory()
    cache_limit = mx.set_cache_limit(0)  # tensors replaced while building go back to malloc, for reuse
    try:
        model = build_model(
            config,
            weights,
            backend.compute_dtype,
            group_size=group_size,
            keep_quantized=backend.keep_quantized,
            rope_freq_factors=factors,
            cpu_kernels=backend.cpu_kernels,
            consume=True,
            shard=shard,
        )
    finally:
        mx.set_cache_limit(cache_limit)
    release_freed_memory()
    return model


def kept_block_types(backend: Backend, shard: Any = None, adapters: Sequence[Adapter] = ()) -> frozenset[str]:
    """The GGUF types whose matrices stay blocks on this backend (`gguf_blocks.kept_on_load`): none
    where no block kernel runs them (a GPU, the reference CPU path, a sharded or adapted model)."""
    if not backend.cpu_kernels or shard is not None or adapters:
        return frozenset()
    from baselm import cpu

    try:
        return gguf_blocks.kept_on_load(cpu.kernels.isa())
    except gguf_blocks.BlockSettingError as exc:
        raise ModelConfigError(str(exc)) from None


def _load_gguf(
    path: Path, backend: Backend, shard: Any = None, adapters: Sequence[Adapter] = (), mmproj: Path | None = None
) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    """A GGUF language model, with the vision tower of the mmproj GGUF `mmproj` beside it when given."""
    from baselm.store import gguf  # and the gguf package (numpy's and yaml's worth of memory): GGUF files only

    checkpoint = gguf.GGUFCheckpoint.open(path)
    # NOTE: the tokenizer first, and its vocabulary's strings freed, before any weight is read:
    # building it briefly takes several times what it keeps, which then never adds to the weights.
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata, default_cache_dir())
    config, projector = checkpoint.config, None
    if mmproj is not None:
        from baselm.store.gguf_mmproj import Mmproj

        projector = Mmproj.open(mmproj)
        config = projector.model_config(config, checkpoint.metadata.get("tokenizer.ggml.tokens") or [])
    checkpoint.release_metadata()
    release_freed_memory()
    weights = checkpoint.mx_weights(keep_blocks=kept_block_types(backend, shard, adapters))
    if projector is not None:
        weights.update(projector.mx_weights())
    model = model_from_checkpoint(config, weights, backend, shard=shard, adapters=adapters)
    return model, tokenizer, config


def _load_hf_folder(
    path: Path, backend: Backend, shard: Any = None, adapters: Sequence[Adapter] = ()
) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    config = hf.read_config(path)
    tokenizer = Tokenizer.from_folder(path)  # first, as in `_load_gguf`
    release_freed_memory()
    # An MLX folder's quantized layers may differ in group size and bits: the shapes tell them.
    model = model_from_checkpoint(config, hf.read_weights(path), backend, shard=shard, adapters=adapters)
    return model, tokenizer, config


def _load_base_file(
    path: Path,
    backend: Backend,
    require_signature: bool = False,
    shard: Any = None,
    adapters: Sequence[Adapter] = (),
) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    base = BaseFile.open(path)
    header = base.header
    # A signed file: signature and header checked now, each tensor's SHA-256 as it is read.
    digests = None
    if require_signature:
        from baselm.store.signed_file import signed_statement  # cryptography: only for a signed load

        digests = signed_statement(base)[0]["tensors_sha256"]
    # NOTE: a rank of a group reads only its slices; a signed load reads every region whole,
    # because a tensor's SHA-256 covers its whole region, and is sliced after.
    is_cut = shard is not None and digests is None
    tokenizer = tokenizer_from_header(header.pop("tokenizer"))  # first, as in `_load_gguf`
    release_freed_memory()
    tensors = shard.read(base) if is_cut else base.load(digests=digests)
    weights, _ = model_weights(tensors)  # bits and group sizes follow from the shapes
    del tensors
    config = header["config"]
    model = model_from_checkpoint(config, weights, backend, shard=shard, adapters=adapters)
    return model, tokenizer, config


def _load_path(
    path: Path,
    backend: Backend,
    require_signature: bool,
    shard: Any,
    adapters: Sequence[Adapter],
    mmproj: Path | None = None,
) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    if mmproj is not None and path.suffix != ".gguf":
        raise ModelFileError(f"--mmproj goes with a .gguf language model, not {path.name}")
    if path.is_dir():
        return _load_hf_folder(path, backend, shard, adapters)
    if path.suffix == ".gguf":
        return _load_gguf(path, backend, shard, adapters, mmproj)
    if path.suffix == ".base":
        return _load_base_file(path, backend, require_signature, shard, adapters)
    raise ModelFileError(f"{path}: not a model; give a store name, a .base or .gguf file, or an HF model folder")


def tokenizer_from_header(spec: dict[str, Any]) -> Tokenizer:
    """The tokenizer a `.base` header carries: GGUF vocabulary metadata, or HF tokenizer files."""
    if "gguf" in spec:
        return Tokenizer.from_gguf_metadata(spec["gguf"], default_cache_dir())
    return Tokenizer.from_hf_files(
        spec["tokenizer.json"], spec.get("tokenizer_config.json") or {}, spec.get("chat_template")
    )


def resolve(ref: str | Path) -> tuple[str, Path]:
    """(name, path) of a reference: an existing path (named by its file or folder), else a name
    in the local store, named as it was given, so `base serve NAME` answers requests for NAME."""
    path = Path(ref).expanduser()
    if path.exists():
        return (path.stem if path.is_file() else path.name), path
    return str(ref), Store().resolve(str(ref)).path


def load_model(
    ref: str | Path,
    backend: Backend,
    require_signature: bool = False,
    shard: Any = None,
    adapters: Sequence[Adapter] = (),
    served_adapters: Sequence[AdapterSpec] = (),
    mmproj: str | Path | None = None,
) -> LoadedModel:
    """Loads a store name, a `.base` file, an HF model folder, a `.gguf` file (a split one by its
    first part) or a folder holding one GGUF model (and its `mmproj*.gguf`, if it has one).

    `require_signature`: only a `.base` file with a good signature by a trusted key loads.
    `shard`: one rank's slice of the model (`baselm.distributed.tp.layers.Sharding`, see `build_model`).
    `adapters`: LoRA adapters added to its weights (baselm/adapters.py).
    `served_adapters`: LoRA adapters requests choose by name, beside the plain model (baselm/served_adapters.py).
    `mmproj`: a vision projector GGUF for a `.gguf` model (store/gguf_mmproj.py)."""
    name, path = resolve(ref)
    if require_signature and not (path.is_file() and path.suffix == ".base"):
        # NOTE: the file, not its name: a folder called `x.base` would load unsigned as an HF folder.
        what = "a folder" if path.is_dir() else "not a .base file"
        raise SignatureError(
            f"{path} is {what}; only .base files carry signatures: `base pull` it, then `base sign` it"
        )
    mmproj = Path(mmproj).expanduser() if mmproj is not None else None
    if mmproj is not None and not mmproj.is_file():
        raise ModelFileError(f"--mmproj {mmproj}: no such file")
    if path.is_dir() and not (path / "config.json").is_file():
        mmproj = mmproj or mmproj_in(path)
        path = first_part_in(path) or path  # a folder of one GGUF model: a file, or a split's parts
    try:
        model, tokenizer, config = _load_path(path, backend, require_signature, shard, adapters, mmproj)
    except BaseFileError:
        if Path(ref).expanduser().exists() or path.exists():
            raise
        # A store name whose file moved between `resolve` and the open (`base cp` moving a file of
        # the older layout into blobs/): the name points at the new place now.
        name, path = resolve(ref)
        model, tokenizer, config = _load_path(path, backend, require_signature, shard, adapters, mmproj)
    served = None
    if served_adapters:
        from baselm.served_adapters import ServedAdapters

        if shard is not None:
            raise AdapterError("adapters chosen per request run in one process; serve the model in one")
        served = ServedAdapters.attach(model, served_adapters, config)
    return LoadedModel(
        name=name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        eos_token_ids=_eos_ids(config, tokenizer),
        backend=backend,
        adapters=tuple(adapters),
        served_adapters=served,
    )
