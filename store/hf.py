"""Reads an HF model folder: config.json, (sharded) safetensors, generation_config.json (eos ids and
sampling defaults), a vision model's preprocessor_config.json, and the tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from baselm.store.errors import ModelFileError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of a model folder, or a ModelFileError that says what is wrong with it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path.parent}: no {path.name}; an HF model folder needs one") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, with eos ids from generation_config.json when it has them (it wins, as in HF), and
    that file kept whole as `generation_config`: the model's own sampling defaults
    (baselm/sampling/defaults.py reads them). A vision model's preprocessor_config.json (its image
    sizes, means, tiling: baselm/vision reads them) is kept whole as `preprocessor_config`."""
    config = read_json(folder / "config.json")
    preprocessor = folder / "preprocessor_config.json"
    if preprocessor.is_file() and config.get("vision_config"):
        config["preprocessor_config"] = read_json(preprocessor)
    path = folder / "generation_config.json"
    if path.is_file():
        generation = read_json(path)
        if generation.get("eos_token_id") is not None:
            config["eos_token_id"] = generation["eos_token_id"]
        config["generation_config"] = generation
    return config


def weight_files(folder: Path) -> list[Path]:
    """The safetensors shards of a folder, from its index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
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


def read_tokenizer_files(folder: Path) -> dict[str, Any]:
    """The tokenizer files of a folder, as a `.base` header's `tokenizer` holds them.

    tokenizer.json as its text (for `Tokenizer.from_str`), the parsed tokenizer_config.json, and
    the chat template: chat_template.jinja, else chat_template.json's, else the config's.
    """
    if not (folder / "tokenizer.json").is_file():
        raise ModelFileError(f"{folder}: no tokenizer.json; base needs the fast tokenizer file")
    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template", template)
    return {
        "tokenizer.json": (folder / "tokenizer.json").read_text(encoding="utf-8"),
        "tokenizer_config.json": config,
        "chat_template": template,
    }
