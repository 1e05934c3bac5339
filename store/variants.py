"""Variant names: what a pull tag and the quantization options ask for, and what it is stored as.

A safetensors tag is a quant scheme (`q4`), a built-in profile (`mixed`) or both (`mixed-q4`);
the default is `q4` with the default profile. A GGUF file keeps its own quant as its variant
(`q4_1`) unless a `quant` is asked for (`q4_1-q8`). A profile file is named by its stem, and a
group size other than the profile's adds `-g<size>` (`mixed-q4-g32`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from baselm.store.errors import StoreError
from baselm.store.hub import Selection
from baselm.store.quantize import BUILTIN_PROFILES, SCHEMES

DEFAULT_QUANT = "q4"
DEFAULT_PROFILE = "default"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a pull stores: the variant name and how to quantize (None: keep the source's)."""

    variant: str
    quant: str | None
    profile: str
    group_size: int | None


def check_quant(quant: str | None) -> None:
    """A clear error for a quantization scheme base does not know (None: none asked for)."""
    if quant is not None and quant not in SCHEMES:
        raise StoreError(f"unknown quantization {quant!r}; choose one of {', '.join(SCHEMES)}")


def plan_variant(
    selection: Selection, tag: str | None, quant: str | None, profile: str | None, group_size: int | None
) -> Plan:
    """The variant name and quantization a tag and options ask for."""
    check_quant(quant)
    if selection.kind == "gguf":  # the file's own quant, or re-quantized to `quant`
        base = (selection.gguf_tag or "gguf").lower()
        profile = profile or DEFAULT_PROFILE
        variant = f"{base}-{variant_name(profile, quant, group_size)}" if quant else base
        return Plan(variant, quant, profile, group_size)
    tag_profile, tag_quant = _parse_tag(tag, BUILTIN_PROFILES, SCHEMES)
    quant = quant or tag_quant or DEFAULT_QUANT
    profile = profile or tag_profile or DEFAULT_PROFILE
    return Plan(variant_name(profile, quant, group_size), quant, profile, group_size)


def variant_name(profile: str, quant: str, group_size: int | None) -> str:
    """`q4`, `mixed-q4`, `myprofile-q4-g32` (a profile file is named by its stem)."""
    name = profile if profile in BUILTIN_PROFILES else Path(profile).stem
    variant = quant if name == DEFAULT_PROFILE else f"{name}-{quant}"
    return variant if group_size is None else f"{variant}-g{group_size}"


def _parse_tag(tag: str | None, profiles: Iterable[str], schemes: Iterable[str]) -> tuple[str | None, str | None]:
    """(profile, scheme) named by a safetensors tag: `q4`, `mixed` or `mixed-q4`."""
    if tag is None:
        return None, None
    tag = tag.lower()
    if tag in schemes:
        return None, tag
    if tag in profiles:
        return tag, None
    head, _, tail = tag.rpartition("-")
    if head in profiles and tail in schemes:
        return head, tail
    raise StoreError(
        f"unknown variant {tag!r}; use a quantization ({', '.join(schemes)}), a profile ({', '.join(profiles)}) or "
        "profile-quant"
    )
