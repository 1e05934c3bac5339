"""Turns a model reference (a path to an HF folder or a GGUF file) into a runnable model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselm.backend import Backend
from baselm.models import build_model
from baselm.models.base import DecoderModel
from baselm.store.errors import ModelFileError
from baselm.tokenizer import Tokenizer


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

    @property
    def max_model_len(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)


def _eos_ids(config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [i for i in tokenizer.eos_token_ids if i not in ids]
    return tuple(ids)


def _load_gguf(path: Path, backend: Backend) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    from baselm.store import gguf

    tensors, metadata = gguf.read_metadata(path)
    config = gguf.hf_config(metadata, set(tensors))
    weights = gguf.hf_tensors(tensors, config)
    del tensors
    model = build_model(
        config, weights, backend.compute_dtype, group_size=gguf.GGUF_GROUP_SIZE, keep_quantized=backend.keep_quantized
    )
    return model, Tokenizer.from_gguf_metadata(metadata), config


def _load_hf_folder(path: Path, backend: Backend) -> tuple[DecoderModel, Tokenizer, dict[str, Any]]:
    from baselm.store import hf

    config = hf.read_config(path)
    quant = config.get("quantization") or {}
    model = build_model(
        config,
        hf.read_weights(path),
        backend.compute_dtype,
        group_size=quant.get("group_size"),
        keep_quantized=backend.keep_quantized,
    )
    return model, Tokenizer.from_folder(path), config


def load_model(ref: str | Path, backend: Backend) -> LoadedModel:
    """Loads `ref`: a folder with config.json and safetensors, or a .gguf file."""
    path = Path(ref).expanduser()
    if path.is_dir():
        model, tokenizer, config = _load_hf_folder(path, backend)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer, config = _load_gguf(path, backend)
    elif path.exists():
        raise ModelFileError(f"{path}: not a model; give an HF model folder or a .gguf file")
    else:
        raise ModelFileError(f"{ref}: no such model file or folder")
    return LoadedModel(
        name=path.stem if path.is_file() else path.name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        eos_token_ids=_eos_ids(config, tokenizer),
        backend=backend,
    )
