"""Split GGUFs: one model in parts named `NAME-00001-of-00003.gguf`, as llama.cpp's gguf-split writes.

Every part is a GGUF of its own with its own tensor table and tensor data; the first also carries
the model's metadata. Each part has `split.no` (0-based), `split.count`, and the first
`split.tensors.count`, the tensors of all parts together. A split model is opened from its first
part, or from the folder that holds its parts; the other parts are found beside it by name, and
each one's number, the count and the tensor total are checked, so a missing, renamed or stray part
is a clear error naming it, never a model with tensors missing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from baselm.store.errors import ModelFileError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(stem: str, index: int, count: int) -> str:
    """The file name of part `index` (0-based) of `count`: `stem-00001-of-00003.gguf` for the first."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.gguf"


def split_stem(name: str) -> str | None:
    """`NAME` of a part's file name `NAME-0000i-of-0000n.gguf`, or None for another name."""
    match = _PART_NAME.match(name)
    return match.group("stem") if match else None


def part_paths(path: Path) -> list[Path]:
    """A GGUF's files as its name says: every part of a split's first part, else the file alone."""
    match = _PART_NAME.match(path.name)
    if match is None or match.group("no") != "00001":
        return [path]
    count = int(match.group("count"))
    return [path.parent / part_name(match.group("stem"), i, count) for i in range(count)]


def num_parts(metadata: Mapping[str, Any]) -> int:
    """How many files the model is in: 1 for a GGUF that is not split."""
    count = metadata.get(SPLIT_COUNT, 1)
    if type(count) is not int or count < 1:
        raise ModelFileError(f"{SPLIT_COUNT} is {count!r}, not a positive count of files")
    return count


def other_parts(first: Path, metadata: Mapping[str, Any]) -> list[Path]:
    """The paths of the parts after `first`, in order ([] for a GGUF that is not split).

    A clear error when `first` is not the first part, is not named as parts are, or a part is missing.
    """
    count = num_parts(metadata)
    if count == 1:
        return []
    index = metadata.get(SPLIT_NO)
    match = _PART_NAME.match(first.name)
    if match is None:
        raise ModelFileError(
            f"{first}: part of a GGUF split into {count} files, but not named NAME-0000i-of-{count:05d}.gguf "
            "as gguf-split names them, so its other parts cannot be found"
        )
    if index != 0:
        first_name = part_name(match.group("stem"), 0, count)
        raise ModelFileError(f"{first} is not the first part of a split GGUF; open {first_name}")
    if int(match.group("count")) != count:
        raise ModelFileError(f"{first}: its name says {int(match.group('count'))} parts, its {SPLIT_COUNT} {count}")
    paths = [first.parent / part_name(match.group("stem"), i, count) for i in range(1, count)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelFileError(
            f"{first}: part(s) {', '.join(missing)} of this {count}-part GGUF are missing from {first.parent}"
        )
    return paths


def check_part(path: Path, metadata: Mapping[str, Any], index: int, count: int) -> None:
    """A clear error unless the part at `path` says it is part `index` (0-based) of `count`."""
    if metadata.get(SPLIT_NO) != index or metadata.get(SPLIT_COUNT) != count:
        raise ModelFileError(
            f"{path}: says it is part {metadata.get(SPLIT_NO)!r} of {metadata.get(SPLIT_COUNT)!r}, "
            f"where part {index} of {count} belongs (a file of another split?)"
        )


def check_tensor_count(first: Path, metadata: Mapping[str, Any], num_tensors: int) -> None:
    expected = metadata.get(SPLIT_TENSORS, num_tensors)
    if expected != num_tensors:
        raise ModelFileError(f"{first}: its parts hold {num_tensors} tensors, but {SPLIT_TENSORS} says {expected}")


def is_mmproj_name(name: str) -> bool:
    """Whether a GGUF file's name says it is a vision projector (llama.cpp's `mmproj` files:
    `mmproj-model-f16.gguf`, `Model-mmproj-F16.gguf`), not a language model."""
    return "mmproj" in Path(name).name.lower()


def first_part_in(folder: Path) -> Path | None:
    """The one GGUF model a folder holds (a file, or a split's first part), None if it holds no GGUF."""
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file() and not is_mmproj_name(p.name))
    models = [p for p in ggufs if (m := _PART_NAME.match(p.name)) is None or m.group("no") == "00001"]
    if len(models) > 1:
        raise ModelFileError(f"{folder} holds more than one GGUF model ({', '.join(p.name for p in models)}); name one")
    return models[0] if models else None


def mmproj_in(folder: Path) -> Path | None:
    """The vision projector (llama.cpp's `mmproj*.gguf`) a folder holds beside its GGUF model, if one."""
    projectors = sorted(p for p in folder.glob("*.gguf") if p.is_file() and is_mmproj_name(p.name))
    if len(projectors) > 1:
        raise ModelFileError(
            f"{folder} holds more than one vision projector ({', '.join(p.name for p in projectors)}); "
            "name one with --mmproj"
        )
    return projectors[0] if projectors else None
