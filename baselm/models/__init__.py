"""Model architectures, one file per HF `model_type`, and building one from weights."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from baselm.memory import release_freed_memory
from baselm.models.attention import Attention
from baselm.models.base import BaseModelArgs, DecoderModel, ModelConfigError
from baselm.models.linear import can_fuse, use_block_layers, use_cpu_kernels
from baselm.models.mlp import MLP

# HF model_type -> module in this package.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3_vlm",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "smollm3": "smollm3",
    "gpt_oss": "gpt_oss",
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(model_type: str) -> tuple[type[BaseModelArgs], type[DecoderModel]]:
    """(ModelArgs, Model) for an HF model_type, or a clear error."""
    module_name = ARCHITECTURES.get(model_type)
    if module_name is None:
        raise ModelConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    module = importlib.import_module(f"baselm.models.{module_name}")
    return module.ModelArgs, module.Model


QUANT_BITS = (2, 3, 4, 5, 6, 8)


def _quant_params(weights: dict[str, mx.array], prefix: str, in_features: int) -> dict[str, Any]:
    """Bits, group size and MLX mode of one quantized tensor: all follow from its arrays and the layer's inputs.

    Affine tensors are `x.weight`/`x.scales`/`x.biases` triplets with float scales; MXFP4 ones are
    `x.weight`/`x.scales` pairs with uint8 (power-of-two exponent) scales, 4 bits in groups of 32.
    """
    codes, scales = weights[prefix + ".weight"], weights[prefix + ".scales"]
    bits, rem_bits = divmod(codes.shape[-1] * 32, in_features)
    group_size, rem_groups = divmod(in_features, scales.shape[-1])
    mode = "mxfp4" if scales.dtype == mx.uint8 else "affine"
    fits = bits in QUANT_BITS if mode == "affine" else (bits, group_size) == (4, 32)
    if rem_bits or rem_groups or not fits:
        raise ModelConfigError(
            f"quantized tensor {prefix} has codes {tuple(codes.shape)} and scales {tuple(scales.shape)}, "
            f"which fit no {'MXFP4 layout' if mode == 'mxfp4' else 'bit width and group size'} "
            f"for {in_features} inputs"
        )
    if (mode == "affine") != (prefix + ".biases" in weights):
        wanted = "needs" if mode == "affine" else "has uint8 (MXFP4) scales and takes no"
        raise ModelConfigError(f"quantized tensor {prefix} {wanted} {prefix}.biases")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def _quantized_prefixes(weights: dict[str, mx.array]) -> list[str]:
    return [n[: -len(".scales")] for n in weights if n.endswith(".scales")]


def _quantization(
    model: nn.Module, weights: dict[str, mx.array], group_size: int | dict[str, int] | None
) -> dict[str, dict[str, int]]:
    """Group size and bits of each quantized triplet (by module path), checked against `group_size` if given."""
    dense = dict(nn.utils.tree_flatten(model.parameters()))
    prefixes = set(_quantized_prefixes(weights))
    unexpected = sorted(p for p in prefixes if p + ".weight" not in dense)
    if unexpected:
        raise ModelConfigError(
            f"checkpoint does not match the architecture: unexpected quantized tensor {unexpected[0]}"
        )
    params = {}
    in_model_order = [n.removesuffix(".weight") for n in dense if n.removesuffix(".weight") in prefixes]
    for prefix in in_model_order:
        found = _quant_params(weights, prefix, dense[prefix + ".weight"].shape[-1])
        wanted = group_size.get(prefix) if isinstance(group_size, dict) else group_size
        if wanted is not None and wanted != found["group_size"]:
            raise ModelConfigError(
                f"quantized tensor {prefix} has groups of {found['group_size']}, not the {wanted} its metadata gives"
            )
        params[prefix] = found
    return params


def _dequantize_triplets(weights: dict[str, mx.array], params: dict[str, dict[str, Any]], dtype: mx.Dtype) -> None:
    """Replaces each quantized `x.weight`/`x.scales`[/`x.biases`] by a dense `x.weight`, in place."""
    for prefix, quant in params.items():
        scales = weights.pop(prefix + ".scales")
        if quant["mode"] == "affine":
            scales, biases = scales.astype(mx.float32), weights.pop(prefix + ".biases").astype(mx.float32)
        else:
            biases = None
        dense = mx.dequantize(weights[prefix + ".weight"], scales, biases, dtype=mx.float32, **quant)
        weights[prefix + ".weight"] = dense.astype(dtype)
        mx.eval(weights[prefix + ".weight"])  # frees the codes now, not at the end


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype = mx.float32,
    group_size: int | dict[str, int] | None = None,
    keep_quantized: bool = False,
    rope_freq_factors: mx.array | None = None,
    cpu_kernels: bool = False,
    consume: bool = False,
    shard: Any = None,
) -> DecoderModel:
    """Instantiates the architecture of `config` and loads `weights` (HF names) into it.

    Quantized tensors (affine triplets, MXFP4 pairs) are either dequantized to `dtype` (the CPU
    path without kernels: float32 through BLAS is its only fast compute) or kept as quantized
    layers (GPU paths, and the CPU with `cpu_kernels`, whose linear layers then run through
    `baselm.cpu`). Their bits, group size and mode follow from the arrays; `group_size` (one for
    all, or per module path), when given, is checked.
    `rope_freq_factors` (rotary_dims // 2,) divide the RoPE frequencies: llama 3 scaling kept outside the config.
    With `consume`, `weights` is emptied as the model takes the arrays over, so tensors that
    loading replaces (dequantized, unpermuted or fused ones) are freed at once.
    `shard` (tensor parallelism, baselm/distributed/tp/layers.py): `shard(model, weights)` resizes the layers to
    one rank's slice and returns the sliced weights; `shard.finish(model)` runs once they are loaded.
    A shard whose `presliced` is set got those split weights already cut from the file: its hook runs
    before any dequantization, so the layers have their sliced shapes when the codes are read.
    """
    args_cls, model_cls = model_class(config.get("model_type", ""))
    args = args_cls.from_dict(config)
    model = model_cls(args)
    if rope_freq_factors is not None:
        model.divide_rope_frequencies(rope_freq_factors)
    given, weights = weights, model.sanitize(dict(weights))
    if consume:
        given.clear()
    del given
    use_block_layers(model, weights, runs_blocks=cpu_kernels and shard is None)
    # Codes are sliced on group boundaries; weights read already cut resize the layers first.
    if shard is not None and (keep_quantized or getattr(shard, "presliced", None)):
        weights = shard(model, weights)
    params = _quantization(model, weights, group_size)
    if params and keep_quantized:
        nn.quantize(model, class_predicate=lambda path, _: params.get(path, False))
    elif params:
        _dequantize_triplets(weights, params, dtype)
    if shard is not None and not keep_quantized and not getattr(shard, "presliced", None):  # dense: any split
        weights = shard(model, weights)
    weights = {k: _cast_float(k, v, dtype, lift_scales=not cpu_kernels) for k, v in weights.items()}
    _check_shapes(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    del weights  # the model holds every array now; fusing below frees the unfused ones
    if cpu_kernels:
        use_cpu_kernels(model)
    if cpu_kernels or not keep_quantized:
        fuse_projections(model)
    if shard is not None:
        shard.finish(model)
    mx.eval(model.parameters())
    return model


def fuse_projections(model: nn.Module) -> None:
    """Fuses q/k/v and gate/up matmuls of every layer of `model` whose projections share one
    format (dense float layers, or kernel-backed quantized ones of one bit width and group size)."""
    for _, module in model.named_modules():
        if isinstance(module, Attention) and can_fuse([module.q_proj, module.k_proj, module.v_proj]):
            module.fuse()
        elif isinstance(module, MLP) and can_fuse([module.gate_proj, module.up_proj]):
            module.fuse()
        else:
            continue
        release_freed_memory()  # the parts' memory, before the next layer's fused copy is made


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


def _cast_float(name: str, value: mx.array, dtype: mx.Dtype, lift_scales: bool = True) -> mx.array:
    """Float parameters in the compute dtype. Quantization scales and biases stay as stored, except
    that a float32 model lifts them to float32 (losslessly) when `lift_scales`: float16 scales would
    make MLX's quantized layers compute, and round, in float16. The CPU kernels read float16
    scales as float32 themselves, so there they keep their stored size."""
    if not mx.issubdtype(value.dtype, mx.floating):
        return value
    if name.endswith((".scales", ".biases")) and (dtype != mx.float32 or not lift_scales):
        return value
    return value.astype(dtype)
