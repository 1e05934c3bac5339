"""Reads an MLX quantized model folder (as mlx-lm saves one) as `.base` records, byte for byte.

Such a folder is an HF folder whose config.json has a `quantization` block:

    "quantization": {"group_size": 64, "bits": 4,
                     "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
                     "model.layers.0.self_attn.q_proj": false}

A quantized module `p` has `p.weight` (uint32 codes), `p.scales` and `p.biases` in MLX's affine
packing, which is the `.base` packing too, so each triplet is carried over as it is. Its group
size comes from the module's own entry, else the block's default; its bits then follow from the
shapes and must agree with the config. mlx-lm names tensors after the model's own parameters
(`model.layers.0...`, `lm_head.weight`): the HF names. Folders whose names lack the `model.`
prefix (`layers.0...`, `embed_tokens.weight`) get it back.

A mixture of experts keeps its experts stacked (mlx-lm's `switch_mlp`): `...mlp.switch_mlp.gate_proj`
(num_experts, out, in), Mixtral's under `block_sparse_moe`. Each expert's matrix is carried over
as the HF tensor of that expert (`mlp.experts.{e}.gate_proj`, Mixtral's `experts.{e}.w1`), a
`.base` matrix of its own, its codes, scales and biases the slices of the stacked ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from baselm.store import hf
from baselm.store.base_format import GROUP_SIZES
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError, UnsupportedModelError

QUANT_KEYS = ("quantization", "quantization_config")
_TOP_LEVEL = ("lm_head.",)
SWITCH = ".switch_mlp."
# mlx-lm's stacked projection -> HF's per-expert name, where it is not the same (Mixtral's)
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def is_mlx_folder(config: dict[str, Any]) -> bool:
    """Whether a folder's config says its weights are MLX affine triplets."""
    return isinstance(config.get("quantization"), dict)


def check_quantization(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The `quantization` block, or a clear error for quantization base cannot carry over."""
    quant = config["quantization"]
    mode = quant.get("mode", "affine")
    if mode != "affine":
        raise UnsupportedModelError(
            f"{folder}: its weights are MLX {mode!r} quantized; base carries over only affine MLX quantization"
        )
    for key in ("group_size", "bits"):
        if type(quant.get(key)) is not int:
            raise ModelFileError(f"{folder}: config.json's quantization block has no integer {key!r}")
    return quant


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config without its quantization blocks: a `.base` file records quantization per tensor."""
    return {k: v for k, v in config.items() if k not in QUANT_KEYS}


def default_bits(config: dict[str, Any]) -> int:
    return int(config["quantization"]["bits"])


def mlx_records(folder: Path, config: dict[str, Any]) -> Iterator[tuple[str, TensorRecord]]:
    """(HF name, record) per tensor, sorted by name; quantized triplets exactly as the files hold them."""
    quant = check_quantization(folder, config)
    weights = hf.read_weights(folder)
    prefixes = {n.removesuffix(".scales") for n in weights if n.endswith(".scales")}
    rename = _renamer(weights)
    for name in sorted(weights, key=rename):
        prefix = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] in prefixes:
            continue
        if prefix in prefixes and name.endswith(".weight"):
            params = _layer_params(quant, prefix, rename(prefix))
            parts = [weights.get(f"{prefix}.{k}") for k in ("weight", "scales", "biases")]
            for hf_name, expert in _experts(rename(name), parts, config):
                yield hf_name, _triplet_record(folder, hf_name.removesuffix(".weight"), expert, params)
        else:
            for hf_name, (value, *_) in _experts(rename(name), [weights[name]], config):
                yield hf_name, TensorRecord.from_array(value)


def _experts(name: str, parts: list[Any], config: dict[str, Any]) -> Iterator[tuple[str, list[Any]]]:
    """(HF name, its parts) of a tensor: a stacked `switch_mlp` one split into one per expert."""
    if SWITCH not in name:
        yield name, parts
        return
    head, _, tail = name.partition(SWITCH)  # tail: "gate_proj.weight"
    projection, _, suffix = tail.partition(".")
    if config.get("model_type") == "mixtral":
        projection = _MIXTRAL_EXPERTS.get(projection, projection)
    for e in range(parts[0].shape[0]):
        yield f"{head}.experts.{e}.{projection}.{suffix}", [p[e] if p is not None else None for p in parts]


def _layer_params(quant: dict[str, Any], prefix: str, hf_prefix: str) -> dict[str, int] | None:
    """A module's group size and bits: its own entry (as the file or HF names it), else the default."""
    own = quant.get(prefix, quant.get(hf_prefix, True))
    if own is False:
        return None
    own = own if isinstance(own, dict) else {}
    return {"group_size": int(own.get("group_size", quant["group_size"])), "bits": int(own.get("bits", quant["bits"]))}


def _triplet_record(folder: Path, prefix: str, parts: list[Any], params: dict[str, int] | None) -> TensorRecord:
    if params is None:
        raise ModelFileError(f"{folder}: {prefix} has quantization scales, but config.json says it is not quantized")
    if parts[2] is None:
        raise UnsupportedModelError(f"{folder}: {prefix} has no biases; base carries over only affine MLX quantization")
    group_size, bits = params["group_size"], params["bits"]
    if group_size not in GROUP_SIZES:
        raise UnsupportedModelError(
            f"{folder}: {prefix} has groups of {group_size}; .base files hold groups of 32, 64 or 128"
        )
    try:
        record = TensorRecord.from_triplet(*parts, group_size=group_size)
    except ValueError:
        record = None
    if record is None or record.bits != bits:
        shapes = ", ".join(str(tuple(p.shape)) for p in parts)
        raise ModelFileError(
            f"{folder}: {prefix}'s codes, scales and biases {shapes} are not {bits}-bit groups of {group_size} as "
            "config.json says"
        )
    return record


def _renamer(weights: dict[str, mx.array]) -> Any:
    """HF names: `model.` put back in front of folders saved without it."""
    if any(n.startswith("model.") for n in weights) or not any(n.startswith("layers.") for n in weights):
        return lambda name: name
    return lambda name: name if name.startswith(_TOP_LEVEL) else f"model.{name}"
