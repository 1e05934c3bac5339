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
    # The quantized tensors not kept exactly from the source's own blocks, by name: "requantized"
    # (from the source's quantized values) or "quantized" (from its floats), filled in as
    # `tensors` is consumed; None: the source's weights were all floats (quantized by base).
    not_exact: dict[str, str] | None = None
    about: dict[str, str] = {}  # kept in the header's `source` (a GGUF's license)


def tensor_origins(quantized: int, floats: int, not_exact: dict[str, str] | None) -> dict[str, int]:
    """How a conversion's tensors came to be (the pull's closing summary): `exact` (kept from the
    source's own quantized blocks), `requantized`, `quantized` (by base, from floats), `float`."""
    how = list(not_exact.values()) if not_exact is not None else ["quantized"] * quantized
    counts = {
        "exact": quantized - len(how),
        "requantized": how.count("requantized"),
        "quantized": how.count("quantized"),
        "float": floats,
    }
    return {key: value for key, value in counts.items() if value}
