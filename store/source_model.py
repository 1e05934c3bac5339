"""`SourceModel`: what a converter reads from a source and hands the `.base` writer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple


class SourceModel(NamedTuple):
    """A model read from an HF folder, a GGUF file or an MLX folder, ready for `write_base_file`.

    NOTE: `tensors` is a stream, consumed once while the file is written; each item is a
    `TensorRecord` or a float array.
    """

    arch: str  # HF model_type
    config: dict[str, Any]  # the HF config
    tokenizer: dict[str, Any]  # the header's `tokenizer`
    tensors: Iterator[tuple[str, Any]]
    quant_scheme: str  # the body's scheme, e.g. "q4"
    quant_profile: str | dict[str, Any]  # a profile's JSON form, or a label such as "gguf-Q4_1"
    num_tensors: int = 0  # how many `tensors` will yield, for progress (0: not known ahead)
