"""The GGUF converter: a `.gguf` file read as a `SourceModel`.

With no `quant` asked for, the file keeps its own quantization: F32/F16/BF16 as they are, the
legacy Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL and the Q2_K ... Q6_K/IQ4_XS matrices as their own blocks byte
for byte (the `.base` block dtypes, a version-2 to -4 file, which the CPU kernels run as they are:
`baselm/gguf_blocks.py`). Stacks of matrices (MoE experts) become exact affine records
(`gguf_quants.py`, `gguf_kquants.py`, `gguf_iquants.py`), but stacked Q2_K and Q6_K, which no
affine group of 32 holds: those are re-quantized on a finer grid and the measured error logged. With a `quant`,
blocks bound for at least as many bits in groups of the same size are widened exactly and the rest
quantized anew; each re-quantization logs one line saying that it compounds error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from baselm import gguf_blocks
from baselm.store import gguf
from baselm.store.gguf_kquants import K_SCHEMES, is_exact
from baselm.store.gguf_mmproj import Mmproj
from baselm.store.gguf_quants import GROUP_SIZE
from baselm.store.hub import gguf_tag
from baselm.store.quantize import (
    QuantProfile,
    dequantize_record,
    quantize_tensor,
    requantize_note,
    resolve_profile,
    widen,
)
from baselm.store.source_model import SourceModel

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")
# The .base scheme a GGUF tensor type is kept as: its affine form's width, or for the types that form
# widens (kept as blocks), the width of the blocks' codes.
_GGUF_SCHEMES = {
    "Q4_0": "q4",
    "Q4_1": "q4",
    "Q5_0": "q5",
    "Q5_1": "q5",
    "Q8_0": "q8",
    **{name: f"q{bits}" for name, (bits, _) in K_SCHEMES.items()},
    "Q2_K": "q2",
    "Q3_K": "q3",
    "IQ4_NL": "q4",
    "IQ4_XS": "q4",
    "F16": "f16",
    "BF16": "bf16",
    "F32": "f32",
}


def gguf_source(
    path: Path, quant: str | None, group_size: int | None, profile_name: str, mmproj: Path | None = None
) -> SourceModel:
    """The file's model with its own quantization (`quant` None), or requantized to `quant`; with
    `mmproj`, a vision projector GGUF, the vision-language model of both (its tower as the projector
    file holds it, kept float by the profile when requantized)."""
    checkpoint = gguf.GGUFCheckpoint.open(path)
    gguf_file, config = checkpoint.file, checkpoint.config
    tokenizer = gguf_tokenizer(gguf_file.metadata)
    # Kept as it is, a matrix of a block type is stored as its blocks (a version-2 or -3 `.base`); asked
    # for a quant, Q2_K/Q6_K tensors are quantized once, from the GGUF's own values.
    keep_blocks = frozenset(gguf_blocks.BY_GGUF_TYPE) if quant is None else frozenset()
    records = checkpoint.records(inexact_as_float=quant is not None, keep_blocks=keep_blocks)
    num = len(gguf_file.tensors)
    if mmproj is not None:
        projector = Mmproj.open(mmproj)
        config = projector.model_config(config, gguf_file.metadata.get("tokenizer.ggml.tokens") or [])
        records = _with_projector(records, projector)
        num += len(projector.file.tensors)
    body = gguf_body_type(gguf_file)
    arch = config["model_type"]
    if quant is None:
        tag = gguf_tag(path.name).upper() or body
        not_exact: dict[str, str] = {}
        kept = _noting_requantized(records, not_exact)
        scheme = _GGUF_SCHEMES[body]
        return SourceModel(arch, config, tokenizer, kept, scheme, f"gguf-{tag}", num, not_exact, _about(gguf_file))
    is_quantized = any(info.type_name not in _FLOAT_TYPES for info in gguf_file.tensors.values())
    if is_quantized and quant not in ("f32", "f16", "bf16"):
        requantize_note(path.name, body, quant)
        # GGUF quants scale groups of 32 weights; new groups that match them cost far less than
        # wider ones, which straddle two source scales (SmolLM2 Q4_1 -> q4 perplexity:
        # +0.14% with groups of 32, +33.7% with 64; see docs/measurements.md).
        group_size = group_size or GROUP_SIZE
    profile = resolve_profile(profile_name, quant, group_size)
    not_exact: dict[str, str] = {}
    tensors = _requantized_gguf(records, profile, not_exact)
    return SourceModel(arch, config, tokenizer, tensors, quant, profile.to_json(), num, not_exact, _about(gguf_file))


def _with_projector(records: Iterator[tuple[str, str, Any]], projector: Mmproj) -> Iterator[tuple[str, str, Any]]:
    """The language model's records, then the projector file's (HF name, GGUF type, record)."""
    yield from records
    yield from projector.records()


def _about(gguf_file: gguf.GGUFFile) -> dict[str, str]:
    """What the header's `source` keeps of the file's own description: its license (`base show`)."""
    license_name = gguf_file.metadata.get("general.license")
    return {"license": license_name} if isinstance(license_name, str) and license_name else {}


def _noting_requantized(
    records: Iterator[tuple[str, str, Any]], not_exact: dict[str, str]
) -> Iterator[tuple[str, Any]]:
    """The records as they are, those of a GGUF type that has no exact affine form and came as no
    blocks (a stacked Q2_K/Q6_K: `GGUFFile.read` re-quantized it) noted in `not_exact` on the way."""
    for name, type_name, record in records:
        if type_name in K_SCHEMES and not is_exact(type_name) and record.block_type is None:
            not_exact[name] = "requantized"
        yield name, record


def gguf_body_type(gguf_file: gguf.GGUFFile) -> str:
    """The tensor type holding most of a GGUF's matrix weights (e.g. Q4_1 beside a Q8_0 embedding)."""
    counts: dict[str, int] = {}
    for info in gguf_file.tensors.values():
        if len(info.shape) >= 2:
            counts[info.type_name] = counts.get(info.type_name, 0) + info.num_params
    return max(sorted(counts), key=counts.get) if counts else "F32"


def gguf_tokenizer(metadata: dict[str, Any]) -> dict[str, Any]:
    """The header's `tokenizer` for a GGUF: its own tokenizer keys, as `Tokenizer.from_gguf_metadata` reads
    them, and the architecture, which says how a Gemma file's SentencePiece vocabulary is read."""
    keys = {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    return {
        "gguf": keys,
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def _requantized_gguf(
    records: Iterator[tuple[str, str, Any]], profile: QuantProfile, not_exact: dict[str, str]
) -> Iterator[tuple[str, Any]]:
    """GGUF tensors stored as `profile` decides. A quantized block bound for at least as many
    bits in groups of the same size is widened exactly (Q4_1 asked for as q5, q6 or q8 keeps
    its values); everything else is dequantized and quantized anew (and noted in `not_exact`)."""
    for name, type_name, value in records:
        if value.bits is not None:
            decision = profile.decide(name, value.shape, "f32")
            if decision.is_quantized:
                exact = widen(value, int(decision.dtype.removeprefix("base_q")), decision.group_size)
                if exact is not None:
                    yield name, exact
                    continue
        record = quantize_tensor(name, dequantize_record(value), profile)[0]
        if record.bits is not None:
            not_exact[name] = "quantized" if type_name in _FLOAT_TYPES else "requantized"
        yield name, record
