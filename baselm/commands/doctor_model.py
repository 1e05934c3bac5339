"""`base doctor MODEL`: what base will do with a model file or folder before it is pulled.

For a GGUF file, tensor type by tensor type: kept as its blocks (and whether this machine runs
them so or converts them at load), kept exactly (the block's values as `.base` holds them),
re-quantized (a type no `.base` dtype holds exactly), kept as floats, or refused (and why);
the architecture and the tokenizer, read or refused by name with the reason; in a folder, the
vision projector (`mmproj*.gguf`) beside it, read or refused. For an HF folder, the weights are
quantized at pull (q4 unless asked otherwise) and floats that stay floats are named; an MLX
folder's weights are kept exactly; a `.base` file is read as it is. Each says whether the model
takes images. Nothing is converted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def model_report(ref: str) -> dict[str, Any]:
    """The report of a file, folder or store name."""
    from baselm.loader import resolve
    from baselm.store.gguf_split import first_part_in, mmproj_in

    name, path = resolve(ref)
    if path.is_file() and path.suffix == ".gguf":
        return {"model": name, "path": str(path), "format": "gguf", **_gguf(path), "images": IMAGES_GGUF_ALONE}
    if path.is_file() and path.suffix == ".base":
        return {"model": name, "path": str(path), "format": "base", **_base(path)}
    first = first_part_in(path) if path.is_dir() and not (path / "config.json").is_file() else None
    if first is not None:  # a folder of one GGUF model, and its vision projector if it has one
        projector = mmproj_in(path)
        images = _projector(projector) if projector else IMAGES_NO
        return {"model": name, "path": str(path), "format": "gguf", **_gguf(first), "images": images}
    if path.is_dir():
        return {"model": name, "path": str(path), **_folder(path)}
    return {"model": name, "path": str(path), "format": "unknown", "refused": f"{path} is no GGUF, .base or folder"}


IMAGES_YES = "yes, through its vision tower"
IMAGES_NO = "no: it reads text only"
IMAGES_GGUF_ALONE = "no: a GGUF alone reads text; a vision projector (llama.cpp's mmproj file) adds images (--mmproj)"


def _images(config: dict[str, Any]) -> str:
    from baselm.store.model_card import has_vision_tower

    return IMAGES_YES if has_vision_tower(config) else IMAGES_NO


def _projector(path: Path) -> str:
    """Whether the vision projector at `path` gives the model images, or why base refuses it."""
    from baselm.store.errors import ModelFileError, UnsupportedModelError
    from baselm.store.gguf_mmproj import Mmproj

    try:
        projector = Mmproj.open(path)
    except (ModelFileError, UnsupportedModelError) as exc:
        return f"refused: {exc}"
    return f"yes, through the vision projector {path.name} ({projector.model_type})"


def _gguf(path: Path) -> dict[str, Any]:
    from baselm.store.errors import ModelFileError, UnsupportedModelError
    from baselm.store.gguf import GGUFCheckpoint, GGUFFile

    gguf_file = GGUFFile.open(path)
    report: dict[str, Any] = {
        "architecture": gguf_file.metadata.get("general.architecture"),
        "tensors": _types(gguf_file, _blocks_run_here()),
    }
    try:
        checkpoint = GGUFCheckpoint.open(path)
        report["model_type"] = checkpoint.config.get("model_type")
    except (UnsupportedModelError, ModelFileError) as exc:
        report["refused"] = str(exc)
    report["tokenizer"] = _gguf_tokenizer(gguf_file.metadata)
    return report


def _blocks_run_here() -> frozenset[str]:
    """The GGUF types whose blocks this machine's backend runs as they are (`loader.kept_block_types`)."""
    from baselm.backend import select_backend
    from baselm.loader import kept_block_types

    return kept_block_types(select_backend("auto"))


def _types(gguf_file: Any, kept: frozenset[str]) -> list[dict[str, Any]]:
    """One row per GGUF tensor type: how many tensors and weights, and what base does with them
    (`kept`: the types whose blocks run as they are here)."""
    rows: dict[str, dict[str, Any]] = {}
    for info in gguf_file.tensors.values():
        row = rows.setdefault(info.type_name, {"type": info.type_name, "tensors": 0, "weights": 0})
        row["tensors"] += 1
        row["weights"] += info.num_params
    for row in rows.values():
        row["action"] = gguf_type_action(row["type"], kept)
    return sorted(rows.values(), key=lambda row: -row["weights"])


def gguf_type_action(type_name: str, kept: frozenset[str] = frozenset()) -> str:
    """What a pull does with tensors of one GGUF type, and a run here (`kept`: the types whose blocks
    run as they are on this machine), in a few words."""
    from baselm.gguf_blocks import BY_GGUF_TYPE as BLOCK_TYPES
    from baselm.store.gguf_affine import affine_form
    from baselm.store.gguf_quants import FLOAT_TYPES, READABLE

    if type_name in FLOAT_TYPES:
        return f"kept as {FLOAT_TYPES[type_name]}"
    if type_name == "MXFP4":
        return "widened to bf16, exactly"
    if type_name not in READABLE:
        return "refused: base cannot read this type (convert the model to a type it reads)"
    bits, exact = affine_form(type_name)
    affine = f"base_q{bits} {'exactly' if exact else 're-quantized'}"
    if type_name in BLOCK_TYPES:
        dtype = BLOCK_TYPES[type_name].dtype
        if type_name in kept:
            return f"kept as its blocks ({dtype}), which the CPU kernels run here; {affine} where no block kernel runs"
        return f"kept as its blocks ({dtype}); runs here (and where no block kernel runs) as {affine}"
    return f"converted to {affine}"  # a quantized type with no block dtype (none now: each has one)


def _gguf_tokenizer(metadata: dict[str, Any]) -> dict[str, Any]:
    from baselm.tokenizer.tokenizer import Tokenizer

    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    report: dict[str, Any] = {
        "model": metadata.get("tokenizer.ggml.model"),
        "pre": metadata.get("tokenizer.ggml.pre"),
        "tokens": len(metadata.get("tokenizer.ggml.tokens") or []),
        "control_tokens": types.count(3),
        "user_defined_tokens": types.count(4),
        "chat_template": bool(metadata.get("tokenizer.chat_template")),
    }
    try:
        Tokenizer.from_gguf_metadata(metadata)
        report["status"] = "read"
    except Exception as exc:  # every refusal says why; the report shows it rather than stopping
        report["status"] = f"refused: {exc}"
    return report


def _base(path: Path) -> dict[str, Any]:
    from baselm.store.base_reader import BaseFile
    from baselm.store.model_card import model_card

    card = model_card(BaseFile.open(path))
    rows = [
        {"type": dtype, "tensors": row["tensors"], "weights": row["params"], "action": "read as stored"}
        for dtype, row in card["quantization"]["by_dtype"].items()
    ]
    images = IMAGES_YES if "vision" in card["capabilities"] else IMAGES_NO
    return {"architecture": card["arch"], "tensors": rows, "origin": card["quantization"]["origin"], "images": images}


def _folder(path: Path) -> dict[str, Any]:
    from baselm.store import hf
    from baselm.store.mlx_folder import is_mlx_folder

    config = hf.read_config(path)
    if is_mlx_folder(config):
        return {"format": "mlx", "architecture": config.get("model_type"), "action": "weights kept exactly"}
    tokenizer = "tokenizer.json" if (path / "tokenizer.json").is_file() else "none (base reads tokenizer.json)"
    return {
        "format": "safetensors",
        "architecture": config.get("model_type"),
        "action": "quantized at pull (q4 unless --quant says otherwise); norms, biases and small tensors stay floats",
        "tokenizer": tokenizer,
        "images": _images(config),
    }


def render_model(report: dict[str, Any]) -> list[str]:
    """The report as the lines `base doctor MODEL` prints."""
    lines = [f"Model {report['model']} ({report['format']}, {report.get('architecture') or '?'})"]
    for row in report.get("tensors", []):
        lines.append(
            f"  {row['type']:<8} {row['tensors']:>5} tensors {row['weights'] / 1e6:>9.1f}M weights  {row['action']}"
        )
    if "action" in report:
        lines.append(f"  weights: {report['action']}")
    tokenizer = report.get("tokenizer")
    if isinstance(tokenizer, dict):
        pre = f", pre {tokenizer['pre']}" if tokenizer.get("pre") else ""
        lines.append(
            f"  tokenizer: {tokenizer['model']}{pre}, {tokenizer['tokens']} tokens ({tokenizer['control_tokens']} "
            f"control, {tokenizer['user_defined_tokens']} user-defined): {tokenizer['status']}"
        )
    elif tokenizer:
        lines.append(f"  tokenizer: {tokenizer}")
    if "images" in report:
        lines.append(f"  images: {report['images']}")
    if report.get("refused"):
        lines.append(f"  refused: {report['refused']}")
    elif report["format"] != "unknown":
        lines.append(f"  {_verdict(report)}")
    return lines


def _verdict(report: dict[str, Any]) -> str:
    tokenizer = report.get("tokenizer")
    if isinstance(tokenizer, dict) and str(tokenizer.get("status", "")).startswith("refused"):
        return "base cannot run it: see the tokenizer"
    if str(report.get("images", "")).startswith("refused"):
        return "base cannot run it with its vision projector (base pull --no-mmproj stores the text model alone)"
    return "base can run it"
