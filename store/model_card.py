"""What a stored model is, read from its `.base` header alone (no weight is read): the facts
`base show` prints, `base inspect` heads its tensor table with, and Ollama's /api/show answers.

One owner for each: the context length a config gives (`context_length`, which the loader uses
too), the shape numbers under Ollama's names (`architecture`), the parameter count as a label
(`parameter_label`), the weights by dtype (`tensor_totals`), where the quantization came from
(`quant_origin`), the chat template a header carries (`chat_template`), and what the model does
under Ollama's names (`capabilities`: `vision` for one with a vision tower).
"""

from __future__ import annotations

import re
from typing import Any

from baselm.store.base_reader import BaseFile

DEFAULT_CONTEXT_LENGTH = 4096  # a config that names none (as the loader has always assumed)
# Sampling values an HF config may carry beside its shape; shown, never applied by base.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# GGUF block types no affine group of 32 holds: a pull without --quant keeps their matrices as blocks but
# re-quantizes their stacks of matrices (MoE experts, gguf_kquants.py).
REQUANTIZED_GGUF_TYPES = ("Q2_K", "Q6_K")


def context_length(config: dict[str, Any]) -> int:
    """The longest sequence the model was made for: its config's `max_position_embeddings` (a
    vision-language model's is its `text_config`'s)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)


def architecture(config: dict[str, Any]) -> dict[str, int]:
    """The shape numbers under the names Ollama's /api/show gives them (after `{arch}.`); those the
    config lacks are left out."""
    values = {
        "context_length": context_length(config),
        "embedding_length": config.get("hidden_size"),
        "block_count": config.get("num_hidden_layers"),
        "attention.head_count": config.get("num_attention_heads"),
        "attention.head_count_kv": config.get("num_key_value_heads"),
        "vocab_size": config.get("vocab_size"),
    }
    return {key: int(value) for key, value in values.items() if isinstance(value, (int, float))}


def has_vision_tower(config: dict[str, Any]) -> bool:
    """Whether a model reads images: its config names a vision tower (the store keeps one only for the
    families base runs with images, which `baselm.vision.image_processor` prepares them for)."""
    return bool(config.get("vision_config"))


def capabilities(config: dict[str, Any], template: str | None) -> list[str]:
    """What the model does, as Ollama's /api/show names it: `completion` and `embedding` (every model
    base serves), `tools` (a chat template that takes them), `vision` (a vision tower)."""
    found = ["completion", "embedding"]
    found += ["tools"] if template and "tools" in template else []
    return found + (["vision"] if has_vision_tower(config) else [])


def parameter_label(num_params: int) -> str:
    """`135M`, `1.5B`: a parameter count as model names and Ollama's `parameter_size` write it."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num_params >= scale:
            return f"{num_params / scale:.1f}{unit}".replace(".0", "")
    return str(num_params)


def tensor_totals(base: BaseFile) -> dict[str, Any]:
    """Tensors, weights and bytes: in all, and by dtype."""
    by_dtype: dict[str, dict[str, int]] = {}
    for entry in base.tensors.values():
        totals = by_dtype.setdefault(entry.dtype, {"tensors": 0, "params": 0, "bytes": 0})
        totals["tensors"] += 1
        totals["params"] += entry.num_params
        totals["bytes"] += entry.length
    num_params = sum(t["params"] for t in by_dtype.values())
    tensor_bytes = sum(t["bytes"] for t in by_dtype.values())
    return {
        "tensors": len(base.tensors),
        "params": num_params,
        "bytes": tensor_bytes,
        "bits_per_weight": round(8 * tensor_bytes / num_params, 3) if num_params else 0.0,
        "by_dtype": by_dtype,
    }


def quant_origin(header: dict[str, Any]) -> str:
    """Where the stored quantization came from, in a sentence: kept from the source's own blocks
    (a GGUF's, an MLX folder's) or quantized by base. The header names it for the whole file
    (`quant_profile`), not tensor by tensor."""
    profile = header.get("quant_profile")
    source_format = str(header.get("source", {}).get("format") or "source")
    if isinstance(profile, str) and profile.startswith("gguf-"):
        tag = profile.removeprefix("gguf-")
        note = f"kept from the GGUF's own {tag} blocks, exactly"
        if "_K" in tag.upper():  # a K-quant mix may hold experts of the types no affine group holds
            note += f"; any stacked (expert) {' or '.join(REQUANTIZED_GGUF_TYPES)} tensors among them were re-quantized"
        return note
    if isinstance(profile, str) and profile.startswith("mlx-"):
        return f"kept from the MLX folder's own {profile.removeprefix('mlx-')} weights, exactly"
    name = profile.get("name") if isinstance(profile, dict) else profile
    if name:
        return f"quantized by base (profile {name}) from the {source_format} weights"
    return f"as the {source_format} stored them"


def chat_template(tokenizer: dict[str, Any]) -> str | None:
    """The chat template a header's `tokenizer` carries (the default one of named templates), or None."""
    template = tokenizer.get("chat_template")
    if template is None:
        template = (tokenizer.get("tokenizer_config.json") or {}).get("chat_template")
    if template is None:
        template = (tokenizer.get("gguf") or {}).get("tokenizer.chat_template")
    if isinstance(template, list):  # HF's named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def model_card(base: BaseFile) -> dict[str, Any]:
    """What `base show` prints (and its --json): architecture, parameters, context, quantization,
    chat template, capabilities (`vision`: it reads images), license and suggested sampling, when
    the header has them."""
    header = base.header
    config = header["config"]
    totals = tensor_totals(base)
    profile = header["quant_profile"]
    license_name = config.get("license") or header["source"].get("license")
    template = chat_template(header["tokenizer"])
    return {
        "path": str(base.path),
        "arch": header["arch"],
        "params": totals["params"],
        "context_length": context_length(config),
        "architecture": architecture(config),
        "quantization": {
            "scheme": header["quant_scheme"],
            "profile": profile.get("name") if isinstance(profile, dict) else profile,
            "origin": quant_origin(header),
            "bits_per_weight": totals["bits_per_weight"],
            "bytes": totals["bytes"],
            "by_dtype": totals["by_dtype"],
        },
        "chat_template": template,
        "capabilities": capabilities(config, template),
        "license": license_name if isinstance(license_name, str) and license_name else None,
        "generation": {key: config[key] for key in GENERATION_KEYS if key in config},
        "source": header["source"],
    }


def template_head(template: str, num_lines: int) -> list[str]:
    """The first `num_lines` lines of a template and, when there are more, a last line saying how many."""
    lines = template.splitlines()
    if len(lines) <= num_lines:
        return lines
    more = len(lines) - num_lines
    return [*lines[:num_lines], f"... {more} more line{'' if more == 1 else 's'}"]


def natural_key(name: str) -> list[int | str]:
    """A sort key that orders the numbers in names by value: layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
