"""`convert`: a model folder or file written as a `.base` file, by the converter its format needs.

HF safetensors folders go to `convert_hf.py`, MLX quantized folders to `convert_mlx.py`, `.gguf`
files to `convert_gguf.py`; each reads its source as a `SourceModel`, which is streamed into
the writer here one tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baselm.store import hf
from baselm.store.base_writer import TensorRecord, write_base_file
from baselm.store.convert_gguf import gguf_source
from baselm.store.convert_hf import hf_source
from baselm.store.convert_mlx import mlx_source
from baselm.store.errors import StoreError
from baselm.store.hub import check_model_type
from baselm.store.mlx_folder import is_mlx_folder
from baselm.store.progress import NoProgress, Progress
from baselm.store.source_model import SourceModel, tensor_origins
from baselm.store.variants import DEFAULT_QUANT

if TYPE_CHECKING:
    from baselm.store.registry import PendingWrite, StoredModel


@dataclass(frozen=True, slots=True)
class Converted:
    """What a conversion wrote: the architecture, the number of weights, the body's scheme, and
    how many tensors were kept exactly, requantized, quantized or left float (`tensor_origins`)."""

    arch: str
    params: int
    quant: str
    tensors: dict[str, int]

    def commit(self, pending: PendingWrite, source: dict[str, Any]) -> StoredModel:
        """Stores the file written into `pending`, its manifest entry recording `source` and the tensor counts."""
        return pending.commit(
            arch=self.arch, params=self.params, quant=self.quant, source={**source, "tensors": self.tensors}
        )


def convert(
    source: Path,
    target: Path,
    quant: str | None,
    group_size: int | None,
    profile: str,
    source_info: dict[str, Any] | None = None,
    supported: Iterable[str] | None = None,
    progress: Progress | None = None,
    mmproj: Path | None = None,
) -> Converted:
    """Writes `source` (an HF or MLX model folder, or a .gguf file, with `mmproj`, its vision
    projector GGUF, when given) as the `.base` file `target`.

    `quant` None keeps an already-quantized source's own quantization (GGUF, MLX folder); an HF
    folder always gets one (q4 by default). Re-quantizing a quantized source logs that it
    compounds error. `progress` hears of each tensor written.
    """
    model = _read_source(source, quant, group_size, profile, mmproj)
    if supported is not None:
        check_model_type(model.config, supported, str(source_info.get("repo") if source_info else source))
    counter = _ParamCounter(model.tensors, progress or NoProgress())
    counter.progress.start(source.name, model.num_tensors, 0)
    write_base_file(
        target,
        counter,
        arch=model.arch,
        config=model.config,
        tokenizer=model.tokenizer,
        quant_scheme=model.quant_scheme,
        quant_profile=model.quant_profile,
        source={**(source_info or {"format": source_format(source), "path": str(source)}), **model.about},
    )
    counter.progress.finish()
    origins = tensor_origins(counter.quantized, counter.floats, model.not_exact)
    return Converted(model.arch, counter.params, model.quant_scheme, origins)


def source_format(source: Path) -> str:
    """`safetensors` (HF folder), `mlx` (MLX quantized folder), `gguf` or `base`."""
    if source.is_dir():
        return "mlx" if is_mlx_folder(hf.read_config(source)) else "safetensors"
    return "base" if source.suffix == ".base" else "gguf"


def _read_source(
    source: Path, quant: str | None, group_size: int | None, profile: str, mmproj: Path | None = None
) -> SourceModel:
    if mmproj is not None and (source.is_dir() or source.suffix != ".gguf"):
        raise StoreError(f"a vision projector goes with a .gguf language model, not {source.name}")
    if source.is_dir() and is_mlx_folder(hf.read_config(source)):
        return mlx_source(source, quant, group_size, profile)
    if source.is_dir():
        return hf_source(source, quant or DEFAULT_QUANT, group_size, profile)
    return gguf_source(source, quant, group_size, profile, mmproj)


class _ParamCounter:
    """Passes (name, record) pairs through, counts the weights' logical elements and reports each tensor."""

    def __init__(self, tensors: Iterator[tuple[str, Any]], progress: Progress) -> None:
        self.tensors, self.params, self.progress = tensors, 0, progress
        self.quantized = self.floats = 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, record in self.tensors:
            self.params += math.prod(record.shape)
            if isinstance(record, TensorRecord) and (record.bits is not None or record.block_type is not None):
                self.quantized += 1
            else:
                self.floats += 1
            yield name, record
            self.progress.advance(1)
