"""LoRA adapters: read from disk, then merged into a model's weights as it loads (`--adapter
PATH[:scale]`), or served beside the plain model and chosen per request (`--lora NAME=PATH[:scale]`,
baselm/served_adapters.py, which applies them at run time through baselm/models/lora.py).

Read from the two folder layouts people train with:

- mlx-lm (`mlx_lm.lora`): `adapters.safetensors` + `adapter_config.json`; each adapted module `P`
  has `P.lora_a` (in, r) and `P.lora_b` (r, out), and `y = W x + s (x a) b` with `s` the config's
  `lora_parameters.scale`: `W += s (a b)^T`.
- PEFT: `adapter_model.safetensors` + `adapter_config.json`; `base_model.model.P.lora_A.weight`
  (r, in) and `.lora_B.weight` (out, r), `W += (lora_alpha / r) B A` (`alpha / sqrt(r)` with rsLoRA).

- GGUF (llama.cpp's `convert_lora_to_gguf.py`): `general.type` adapter, `adapter.type` lora,
  `adapter.lora.alpha`; `blk.N.attn_q.weight.lora_a` (r, in) and `.lora_b` (out, r), the
  tensors under GGUF names, `W += (alpha / r) B A`. Where llama.cpp permuted the base model's q/k
  rows (llama, smollm3) it permuted `lora_b`'s rows the same way; they are put back in HF order.

`:scale` multiplies an adapter's own factor (1 by default); several adapters add up. A float
weight takes the product exactly; a quantized one is dequantized, given it and quantized again to
its own bits and groups, which adds one rounding step (as merging any adapter into quantized
weights does). Adapters for modules the model does not have, or of other shapes, are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model; the message says why."""


@dataclass(frozen=True, slots=True)
class Delta:
    """One module's change, `factor * up @ down` (out, in); `heads`: the config key whose head count
    undoes llama.cpp's q/k row permutation of `up` (GGUF adapters of llama models), else None."""

    up: mx.array  # (out, r)
    down: mx.array  # (r, in)
    factor: float
    heads: str | None = None


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter: its deltas by adapted module (HF name, without `.weight`)."""

    path: Path
    deltas: dict[str, Delta]
    scale: float = 1.0  # the `:scale` asked for (already in the deltas' factors)


def read_adapter(spec: str) -> Adapter:
    """`PATH[:scale]`: an mlx-lm or PEFT adapter folder or a GGUF LoRA, its factor multiplied by `scale`."""
    path_text, scale = split_scale(spec)
    path = Path(path_text).expanduser()
    if path.suffix == ".gguf":
        return Adapter(path, _gguf(path, scale), scale)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path}: no adapter_config.json; an adapter is an mlx-lm or PEFT adapter folder")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{config_file}: not valid JSON ({exc})") from None
    if (path / "adapters.safetensors").is_file():
        return Adapter(path, _mlx_lm(path, config, scale), scale)
    if (path / "adapter_model.safetensors").is_file():
        return Adapter(path, _peft(path, config, scale), scale)
    raise AdapterError(f"{path}: neither adapters.safetensors (mlx-lm) nor adapter_model.safetensors (PEFT)")


def split_scale(spec: str) -> tuple[str, float]:
    """`PATH[:scale]` as (PATH, scale); 1 when no scale is given."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and _is_number(tail):
        return head, float(tail)
    return spec, 1.0


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _mlx_lm(path: Path, config: dict[str, Any], scale: float) -> dict[str, Delta]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{path}: a {kind!r} adapter; base applies LoRA adapters")
    factor = float((config.get("lora_parameters") or {}).get("scale", 20.0)) * scale
    tensors = mx.load(str(path / "adapters.safetensors"))
    deltas = {}
    for name in sorted(tensors):
        if name.endswith(".lora_a"):
            module = name.removesuffix(".lora_a")
            up = tensors.get(f"{module}.lora_b")
            if up is None:
                raise AdapterError(f"{path}: {module} has lora_a but no lora_b")
            deltas[module] = Delta(up.T, tensors[name].T, factor)  # a (in, r), b (r, out)
        elif not name.endswith(".lora_b"):
            raise AdapterError(f"{path}: {name} is not a LoRA tensor (lora_a, lora_b)")
    return deltas


def _peft(path: Path, config: dict[str, Any], scale: float) -> dict[str, Delta]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: a {config.get('peft_type')} adapter; base applies LoRA adapters")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    factor = (alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank) * scale
    tensors = mx.load(str(path / "adapter_model.safetensors"))
    deltas = {}
    for name in sorted(tensors):
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0].removeprefix("base_model.model.")
            up = tensors.get(name.replace(".lora_A.", ".lora_B."))
            if up is None:
                raise AdapterError(f"{path}: {module} has lora_A but no lora_B")
            deltas[module] = Delta(up, tensors[name], factor)
        elif ".lora_B." not in name:
            raise AdapterError(f"{path}: {name} is not a LoRA tensor (modules_to_save and DoRA are not applied)")
    return deltas


def _gguf(path: Path, scale: float) -> dict[str, Delta]:
    from baselm.store.errors import ModelFileError
    from baselm.store.gguf import GGUFFile
    from baselm.store.gguf_arch import ARCHS, GLOBAL_TENSORS, LAYER_TENSORS
    from baselm.store.quantize import dequantize_record

    try:
        gguf_file = GGUFFile.open(path)
    except (ModelFileError, OSError) as exc:
        raise AdapterError(f"{path}: {exc}") from None
    meta = gguf_file.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a GGUF LoRA adapter (general.type adapter, adapter.type lora)")
    spec = ARCHS.get(str(meta.get("general.architecture")))
    if spec is None:
        raise AdapterError(f"{path}: adapters of {meta.get('general.architecture')!r} GGUF models are not read")
    alpha = meta.get("adapter.lora.alpha")
    deltas = {}
    for name, info in gguf_file.tensors.items():
        if not name.endswith(".lora_a"):
            if not name.endswith(".lora_b"):
                raise AdapterError(f"{path}: {name} is not a LoRA tensor (lora_a, lora_b)")
            continue
        base = name.removesuffix(".weight.lora_a")
        layer, _, stem = base.removeprefix("blk.").partition(".") if base.startswith("blk.") else ("", "", base)
        target = LAYER_TENSORS.get(stem) if layer else GLOBAL_TENSORS.get(stem)
        partner = gguf_file.tensors.get(f"{base}.weight.lora_b")
        if target is None or partner is None:
            raise AdapterError(f"{path}: {name} adapts no tensor base knows, or has no lora_b")
        down, up = (dequantize_record(gguf_file.read(t)) for t in (info, partner))
        rank = down.shape[0]
        factor = (float(alpha) / rank if alpha else 1.0) * scale
        heads = (
            {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(stem) if spec.permute_qk else None
        )
        deltas[f"model.layers.{layer}.{target}" if layer else target] = Delta(up, down, factor, heads)
    return deltas


def factors(change: Delta, config: dict[str, Any]) -> tuple[mx.array, mx.array]:
    """(up (out, r), down (r, in)) of one module's change in float32, `up`'s rows in HF order;
    `config`, the model's, gives the head counts a GGUF adapter's q/k rows are put back with."""
    from baselm.store.gguf import unpermute_rows

    up = change.up.astype(mx.float32)
    if change.heads is not None:
        up = mx.array(unpermute_rows(np.array(up), int(config[change.heads])))
    return up, change.down.astype(mx.float32)


def apply_adapters(weights: dict[str, mx.array], adapters: list[Adapter], config: dict[str, Any]) -> None:
    """Adds each adapter's deltas to `weights` (HF names; quantized triplets re-quantized), in place;
    `config` is the model's (see `factors`)."""
    for adapter in adapters:
        for module, change in adapter.deltas.items():
            key = f"{module}.weight"
            if key not in weights:
                raise AdapterError(f"{adapter.path}: it adapts {module}, which this model does not have")
            up, down = factors(change, config)
            delta = change.factor * (up @ down)
            if f"{module}.scales" in weights:
                _add_quantized(weights, module, delta, adapter.path)
            elif weights[key].shape != delta.shape:
                raise AdapterError(
                    f"{adapter.path}: {module} is {tuple(weights[key].shape)}, its delta {tuple(delta.shape)}"
                )
            else:
                weights[key] = (weights[key].astype(mx.float32) + delta).astype(weights[key].dtype)


def _add_quantized(weights: dict[str, mx.array], module: str, delta: mx.array, path: Path) -> None:
    codes, scales, biases = (weights[f"{module}.{k}"] for k in ("weight", "scales", "biases"))
    out, inputs = delta.shape
    if codes.shape[0] != out or (codes.shape[1] * 32) % inputs:
        raise AdapterError(f"{path}: {module}'s delta {tuple(delta.shape)} does not fit its quantized weight")
    bits = codes.shape[1] * 32 // inputs
    group_size = inputs // scales.shape[1]
    values = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits).astype(mx.float32) + delta
    new = mx.quantize(values.astype(scales.dtype), group_size=group_size, bits=bits)
    weights[f"{module}.weight"], weights[f"{module}.scales"], weights[f"{module}.biases"] = new
