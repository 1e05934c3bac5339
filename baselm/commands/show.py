"""`base show`: what a stored model is, read from its `.base` header (no weight is loaded), in
sections as `ollama show` prints them; `--json` for a machine, `--template` for the chat template
alone. The facts are `store/model_card.py`'s, which `base inspect` and /api/show share."""

from __future__ import annotations

import json
from typing import Any

from baselm.config import format_size
from baselm.store.model_card import parameter_label, template_head

TEMPLATE_LINES = 6
LABEL_WIDTH = 20
# The shape numbers of `model_card.architecture`, as the Model section names them.
SHAPE_LABELS = {
    "embedding_length": "embedding length",
    "block_count": "layers",
    "attention.head_count": "attention heads",
    "attention.head_count_kv": "KV heads",
    "vocab_size": "vocabulary",
}


class ShowError(ValueError):
    """What `base show` was asked cannot be shown; the message says why."""


def show_model(ref: str, as_json: bool, template_only: bool) -> None:
    """Prints the model card of `ref` (a store name or a .base file): as text, as JSON, or only its
    chat template. A model that is not a `.base` file raises ModelFileError saying how to store it."""
    card = read_card(ref)
    if as_json:
        print(json.dumps(card, indent=2, ensure_ascii=False))
    elif template_only:
        if card["chat_template"] is None:
            raise ShowError(f"{card['name']} has no chat template (base run --raw prompts it as plain text)")
        print(card["chat_template"])
    else:
        print("\n".join(card_lines(card)))


def read_card(ref: str) -> dict[str, Any]:
    """The model card of a store name or a `.base` file, with the name it was asked by."""
    from pathlib import Path

    from baselm.store.base_reader import BaseFile
    from baselm.store.errors import ModelFileError
    from baselm.store.model_card import model_card
    from baselm.store.registry import Store

    path = Path(ref).expanduser()
    stored = None if path.exists() else Store().resolve(ref)
    path = stored.path if stored is not None else path
    if not path.is_file() or path.suffix != ".base":
        kind = "a folder" if path.is_dir() else f"a {path.suffix or 'plain'} file"
        raise ModelFileError(f"{path} is {kind}; base show reads stored models: `base pull {path}` stores it")
    card = {"name": ref if stored is not None else path.stem, **model_card(BaseFile.open(path))}
    if stored is not None:  # one file may hold several names, each from its own source: this name's
        card["source"] = {**card["source"], **stored.source}
    return card


def card_lines(card: dict[str, Any]) -> list[str]:
    """The card as text: Model, Quantization, Capabilities, Chat template, then License and Parameters
    when known."""
    lines = _section("Model", _model_rows(card))
    lines += _section("Quantization", _quant_rows(card["quantization"]))
    lines += _section("Capabilities", [(name, "") for name in card["capabilities"]])
    template = card["chat_template"]
    lines += ["", "  Chat template" + ("" if template is None else "  (--template prints it whole)")]
    lines += [f"    {line}" for line in (template_head(template, TEMPLATE_LINES) if template else ["none"])]
    if card["license"]:
        lines += _section("License", [(line, "") for line in card["license"].splitlines()[:TEMPLATE_LINES]])
    if card["generation"]:
        lines += _section("Parameters", [(k, str(v)) for k, v in card["generation"].items()])
        lines.append("    (the model's suggested sampling; base applies only what a request asks)")
    return lines


def _model_rows(card: dict[str, Any]) -> list[tuple[str, str]]:
    shape = card["architecture"]
    rows = [
        ("architecture", card["arch"]),
        ("parameters", parameter_label(card["params"])),
        ("context length", str(card["context_length"])),
    ]
    rows += [(label, str(shape[key])) for key, label in SHAPE_LABELS.items() if key in shape]
    source = card["source"]
    origin = source.get("repo") or source.get("path")
    rows.append(("source", f"{source.get('format', '?')}" + (f", {origin}" if origin else "")))
    return rows


def _quant_rows(quant: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (
            "stored as",
            f"{quant['scheme']}, {quant['bits_per_weight']:.2f} bits per weight, {format_size(quant['bytes'], 'MiB')}",
        ),
        ("origin", quant["origin"]),
    ]
    for dtype, totals in sorted(quant["by_dtype"].items(), key=lambda item: -item[1]["params"]):
        num = totals["tensors"]
        rows.append((dtype, f"{num} tensor{'' if num == 1 else 's'}, {parameter_label(totals['params'])} weights"))
    return rows


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    return ["", f"  {title}", *(f"    {key:<{LABEL_WIDTH}}{value}".rstrip() for key, value in rows)]
