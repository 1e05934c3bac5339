"""Model architectures, one file per HF `model_type`, and building one from weights."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.models.base import DecoderModel, ModelConfigError

# HF model_type -> module in this package.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(model_type: str):
    """(ModelArgs, Model) for an HF model_type, or a clear error."""
    module_name = ARCHITECTURES.get(model_type)
    if module_name is None:
        raise ModelConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    module = importlib.import_module(f"baselm.models.{module_name}")
    return module.ModelArgs, module.Model


def _quant_params(weights: dict[str, mx.array], prefix: str, group_size: int) -> dict[str, int]:
    """Group size and bits of one quantized triplet; bits follow from the shapes and the group size."""
    codes, scales = weights[prefix + ".weight"], weights[prefix + ".scales"]
    in_features = scales.shape[-1] * group_size
    bits, rem = divmod(codes.shape[-1] * 32, in_features)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise ModelConfigError(f"quantized tensor {prefix} has inconsistent codes/scales shapes")
    return {"group_size": group_size, "bits": bits}


def _quantized_prefixes(weights: dict[str, mx.array]) -> list[str]:
    return [n[: -len(".scales")] for n in weights if n.endswith(".scales")]


def _dequantize_triplets(weights: dict[str, mx.array], group_sizes: dict[str, int], dtype: mx.Dtype) -> None:
    """Replaces each `x.weight`/`x.scales`/`x.biases` triplet by a dense `x.weight`, in place."""
    for prefix in _quantized_prefixes(weights):
        params = _quant_params(weights, prefix, group_sizes[prefix])
        scales = weights.pop(prefix + ".scales").astype(mx.float32)
        biases = weights.pop(prefix + ".biases").astype(mx.float32)
        dense = mx.dequantize(weights[prefix + ".weight"], scales, biases, **params)
        weights[prefix + ".weight"] = dense.astype(dtype)
        mx.eval(weights[prefix + ".weight"])  # frees the codes now, not at the end


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype = mx.float32,
    group_size: int | dict[str, int] | None = None,
    keep_quantized: bool = False,
) -> DecoderModel:
    """Instantiates the architecture of `config` and loads `weights` (HF names) into it.

    Quantized triplets (`group_size`: one for all, or per tensor prefix) are either dequantized to
    `dtype` (the CPU path: float32 through BLAS is the only fast CPU compute) or kept as
    `nn.QuantizedLinear`/`QuantizedEmbedding` layers (GPU paths).
    """
    args_cls, model_cls = model_class(config.get("model_type", ""))
    args = args_cls.from_dict(config)
    model = model_cls(args)
    weights = model.sanitize(dict(weights))
    prefixes = _quantized_prefixes(weights)
    if prefixes and group_size is None:
        raise ModelConfigError("quantized tensors found but no group size given")
    group_sizes = group_size if isinstance(group_size, dict) else {p: group_size for p in prefixes}
    if prefixes and keep_quantized:
        params = {p: _quant_params(weights, p, group_sizes[p]) for p in prefixes}
        nn.quantize(model, class_predicate=lambda path, _: params.get(path, False))
    elif prefixes:
        _dequantize_triplets(weights, group_sizes, dtype)
    weights = {k: _cast_float(k, v, dtype) for k, v in weights.items()}
    _check_shapes(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _check_shapes(model: nn.Module, weights: dict[str, mx.array]) -> None:
    expected = dict(nn.utils.tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        raise ModelConfigError("checkpoint does not match the architecture: " + "; ".join(parts))
    for name, param in expected.items():  # in the model's order, so the first bad tensor is reported
        if param.shape != weights[name].shape:
            raise ModelConfigError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, the config implies {tuple(param.shape)}"
            )


def _cast_float(name: str, value: mx.array, dtype: mx.Dtype) -> mx.array:
    """Float parameters in the compute dtype; quantization scales and biases stay as stored."""
    if name.endswith((".scales", ".biases")) or not mx.issubdtype(value.dtype, mx.floating):
        return value
    return value.astype(dtype)
