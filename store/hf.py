"""Reads an HF model folder: config.json, (sharded) safetensors, generation_config.json eos ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from baselm.store.errors import ModelFileError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path.parent}: no {path.name}; an HF model folder needs one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, with eos ids from generation_config.json when it has them (it wins, as in HF)."""
    config = _read_json(folder / "config.json")
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def weight_files(folder: Path) -> list[Path]:
    """The safetensors shards of a folder, from its index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelFileError(f"{folder}: shards listed in its index are missing: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors weights found")
    return files


def read_weights(folder: Path) -> dict[str, mx.array]:
    """All tensors of the folder's shards (lazily mapped by MLX until used)."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(folder):
        try:
            weights.update(mx.load(str(path), format="safetensors"))
        except Exception as exc:  # MLX raises bare RuntimeError on malformed files
            raise ModelFileError(f"{path}: not a readable safetensors file ({exc})") from None
    return weights
