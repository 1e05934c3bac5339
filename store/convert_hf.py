"""The HF safetensors converter: an HF model folder read as a `SourceModel`, quantized by a profile."""

from __future__ import annotations

from pathlib import Path

from baselm.store import hf
from baselm.store.errors import UnsupportedModelError
from baselm.store.mxfp4 import widen_mxfp4
from baselm.store.quantize import quantize_tensors, resolve_profile
from baselm.store.source_model import SourceModel


def hf_source(folder: Path, quant: str, group_size: int | None, profile_name: str) -> SourceModel:
    """The folder's config, tokenizer files and weights, quantized to `quant` as the profile decides.

    MXFP4 tensors (gpt-oss experts) are widened to bfloat16 first, exactly: `.base` has no MXFP4
    dtype. (`base chat` on the folder itself runs them as MXFP4.)
    """
    config = hf.read_config(folder)
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(
            f"{folder}: its weights are {method}-quantized, which base cannot read; use the unquantized model"
        )
    weights = hf.read_weights(folder)
    if method == "mxfp4":
        weights = widen_mxfp4(weights)
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    profile = resolve_profile(profile_name, quant, group_size)
    tensors = quantize_tensors(((n, weights[n]) for n in sorted(weights)), profile)
    tokenizer = hf.read_tokenizer_files(folder)
    arch = str(config.get("model_type"))
    return SourceModel(arch, config, tokenizer, tensors, quant, profile.to_json(), len(weights))
