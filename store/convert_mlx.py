"""The MLX folder converter: an MLX quantized folder read as a `SourceModel`.

Its affine triplets are carried over exactly (see `mlx_folder.py`) unless a `quant` is asked
for; then they are dequantized and quantized anew, and a note says that compounds error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from baselm.store import hf, mlx_folder
from baselm.store.quantize import dequantize_record, quantize_tensors, requantize_note, resolve_profile
from baselm.store.source_model import SourceModel


def mlx_source(folder: Path, quant: str | None, group_size: int | None, profile_name: str) -> SourceModel:
    """The folder's model with its own quantization (`quant` None), or requantized to `quant`."""
    config = hf.read_config(folder)
    mlx_folder.check_quantization(folder, config)
    bits = mlx_folder.default_bits(config)
    plain = mlx_folder.plain_config(config)
    records = mlx_folder.mlx_records(folder, config)
    arch, tokenizer = str(plain.get("model_type")), hf.read_tokenizer_files(folder)
    if quant is None:
        return SourceModel(arch, plain, tokenizer, records, f"q{bits}", f"mlx-q{bits}", not_exact={})
    requantize_note(folder.name, f"MLX q{bits}", quant)
    profile = resolve_profile(profile_name, quant, group_size)
    not_exact: dict[str, str] = {}
    was_quantized: set[str] = set()
    floats = ((name, _values(name, record, was_quantized)) for name, record in records)
    tensors = _noting(quantize_tensors(floats, profile), was_quantized, not_exact)
    return SourceModel(arch, plain, tokenizer, tensors, quant, profile.to_json(), not_exact=not_exact)


def _values(name: str, record: Any, was_quantized: set[str]) -> Any:
    """`record`'s float values, its name added to `was_quantized` when the folder held it quantized."""
    if record.bits is not None:
        was_quantized.add(name)
    return dequantize_record(record)


def _noting(
    tensors: Iterator[tuple[str, Any]], was_quantized: set[str], not_exact: dict[str, str]
) -> Iterator[tuple[str, Any]]:
    """`tensors` as they are, each quantized one noted in `not_exact` as requantized or quantized."""
    for name, record in tensors:
        if record.bits is not None:
            not_exact[name] = "requantized" if name in was_quantized else "quantized"
        yield name, record
