"""Quantization schemes (Q2-Q8 affine, f16/bf16/f32) and profiles that pick one per tensor.

Affine quantization, per group of `group_size` consecutive input features of a row:
`scale = (max - min) / (2**bits - 1)`, `bias = min`, `q = round((w - bias) / scale)`, and
`w ~ scale * q + bias`. Scale and bias are rounded to `scale_dtype` *before* the codes are
computed, so every in-range value is within half a step (`scale / 2`) of its reconstruction,
up to that rounding. This is the min/max grid; `mx.quantize` instead pins the larger-magnitude
end and makes zero exact, which can cost a whole step at the other end. The codes are packed
exactly as MLX packs them (value i of a row at bit `i * bits`, little-endian, a contiguous bit
stream for 3/5/6 bits), so the result feeds `mx.quantized_matmul` / `mx.dequantize` as it is.

A profile is an ordered list of rules `pattern -> scheme [, group_size]`; the first rule whose
pattern matches the tensor's name wins. Only 2-D `*.weight` tensors are ever quantized, and only
when the group size divides their input dimension. A scheme's default group size steps down
(128 -> 64 -> 32) until one divides (hidden sizes like 576 = 9 * 64 are common); a group size
the rule names is kept as it is. A tensor no group fits stays float, and the decision says why.
`float` as a rule's scheme keeps the tensor's source float dtype.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from baselm import gguf_blocks
from baselm.store.base_format import FLOAT_DTYPES, GROUP_SIZES, float_numpy, to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ProfileError, QuantizationError

KEEP_FLOAT = "float"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Scheme:
    """A storage scheme: affine `bits` with a default group size, or a float dtype."""

    name: str
    bits: int | None = None
    group_size: int | None = None

    @property
    def is_quantized(self) -> bool:
        return self.bits is not None

    @property
    def dtype(self) -> str:
        """The `.base` dtype of tensors stored with this scheme."""
        return f"base_q{self.bits}" if self.bits is not None else self.name


# Smaller groups for the fewest bits, where a group's range costs the most accuracy.
SCHEMES: dict[str, Scheme] = {
    "q2": Scheme("q2", 2, 32),
    "q3": Scheme("q3", 3, 32),
    "q4": Scheme("q4", 4, 64),
    "q5": Scheme("q5", 5, 64),
    "q6": Scheme("q6", 6, 64),
    "q8": Scheme("q8", 8, 128),
    "f16": Scheme("f16"),
    "bf16": Scheme("bf16"),
    "f32": Scheme("f32"),
}


# ---------------------------------------------------------------------------------------------
# Bit packing and the quantizer


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """(out, in) integer codes in [0, 2**bits) -> (out, in * bits / 32) uint32 in MLX's packing:
    value i of a row at bit `i * bits` of its little-endian bit stream.

    Eight values make `bits` whole bytes. Read as one little-endian uint64 (value j in byte j),
    three steps of masks and shifts close the gaps between pairs of values, then pairs of pairs,
    then quads, and the word's low `bits` bytes are the packed ones.
    """
    out_features, in_features = q.shape
    values = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 8:
        packed = values
    elif bits == 4:
        packed = values[:, 0::2] | (values[:, 1::2] << np.uint8(4))  # (out, in / 2)
    else:
        packed = _pack_words(values.reshape(-1), bits)
    return np.ascontiguousarray(packed).view("<u4").reshape(out_features, in_features * bits // 32)


_PACK_CHUNK = 1 << 20  # values per pass: the temporaries stay in the CPU's cache


def _pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """(n,) uint8 values, n a multiple of 8, -> (n * bits / 8,) bytes of their bit stream."""
    steps = []
    width, count = 8, bits  # each lane of `width` bits holds `count` valid low bits
    while width < 64:
        low = sum(((1 << count) - 1) << (k * 2 * width) for k in range(32 // width))
        steps.append((np.uint64(low), np.uint64(low << width), np.uint64(width - count)))
        width, count = 2 * width, 2 * count
    packed = np.empty(values.size * bits // 8, dtype=np.uint8)
    for start in range(0, values.size, _PACK_CHUNK):
        words = values[start : start + _PACK_CHUNK].view("<u8")  # (m,): 8 values each
        for low, high, shift in steps:
            words = (words & low) | ((words & high) >> shift)
        at = start * bits // 8
        packed[at : at + words.size * bits] = words.view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)
    return packed


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(out, in * bits / 32) uint32 packed codes -> (out, in) uint8 values."""
    out_features, num_words = codes.shape
    if bits in (4, 8):  # whole bytes, or two values a byte (low nibble first)
        packed = np.ascontiguousarray(codes, dtype="<u4").view(np.uint8).reshape(out_features, -1)
        if bits == 8:
            return packed.copy()
        values = np.empty((out_features, packed.shape[1] * 2), dtype=np.uint8)
        values[:, 0::2], values[:, 1::2] = packed & np.uint8(0x0F), packed >> np.uint8(4)
        return values
    words = codes.astype(np.uint32).reshape(out_features, num_words // bits, bits)  # (out, in/32, bits)
    values = np.empty((out_features, num_words // bits, 32), dtype=np.uint32)  # (out, in/32, 32)
    mask = np.uint32((1 << bits) - 1)
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        value = words[..., word] >> np.uint32(shift)
        if shift + bits > 32:
            value = value | (words[..., word + 1] << np.uint32(32 - shift))
        values[..., j] = value & mask
    return values.reshape(out_features, -1).astype(np.uint8)


def _round_to(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored raw values, their float32 value) of float32 `values` rounded to `dtype`."""
    if dtype == "bf16":  # round to nearest even on the upper 16 bits
        bits = values.view(np.uint32)
        stored = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")
        return stored, to_float32(stored, "bf16")
    with np.errstate(over="ignore"):  # an overflow becomes inf, which the caller rejects
        stored = values.astype(FLOAT_DTYPES[dtype])
    return stored, stored.astype(np.float32)


def quantize(
    weight: np.ndarray | mx.array, bits: int, group_size: int, scale_dtype: str = "f16", name: str = "tensor"
) -> TensorRecord:
    """Affine-quantizes a 2-D float matrix along its input dimension into a `base_q{bits}` record."""
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in GROUP_SIZES or scale_dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"{name}: cannot quantize to {bits} bits, group {group_size}, scales {scale_dtype}")
    raw, dtype = float_numpy(weight)
    w = to_float32(raw, dtype)  # (out, in)
    if w.ndim != 2 or w.shape[1] % group_size:
        raise QuantizationError(f"{name}: shape {list(w.shape)} is not 2-D with inputs divisible by {group_size}")
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group_size, group_size)  # (out, in/g, g)
    w_min, w_max = groups.min(axis=-1), groups.max(axis=-1)  # (out, in/g)
    levels = (1 << bits) - 1
    scales, scale_values = _round_to(((w_max - w_min) / levels).astype(np.float32), scale_dtype)
    biases, bias_values = _round_to(w_min.astype(np.float32), scale_dtype)
    if not (np.isfinite(scale_values).all() and np.isfinite(bias_values).all()):
        raise QuantizationError(f"{name}: values are not finite or overflow {scale_dtype} scales; use scale dtype f32")
    divisor = np.where(scale_values == 0, 1, scale_values)[..., None]
    q = np.rint((groups - bias_values[..., None]) / divisor).clip(0, levels).astype(np.uint8)  # (out, in/g, g)
    codes = pack_codes(q.reshape(out_features, in_features), bits)  # (out, in * bits / 32)
    return TensorRecord(
        dtype=f"base_q{bits}",
        shape=(out_features, in_features),
        codes=codes,
        scales=np.ascontiguousarray(scales),
        biases=np.ascontiguousarray(biases),
        group_size=group_size,
        scale_dtype=scale_dtype,
    )


# ---------------------------------------------------------------------------------------------
# Profiles


@dataclass(frozen=True, slots=True)
class Rule:
    """`pattern` (a glob, or a regex searched in the name when `is_regex`) -> `scheme`."""

    pattern: str
    scheme: str
    group_size: int | None = None
    is_regex: bool = False

    def matches(self, name: str) -> bool:
        if self.is_regex:
            return re.search(self.pattern, name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)

    def to_json(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"regex" if self.is_regex else "match": self.pattern, "scheme": self.scheme}
        if self.group_size is not None:
            rule["group_size"] = self.group_size
        return rule


@dataclass(frozen=True, slots=True)
class Decision:
    """What a profile does with one tensor: the `.base` dtype, group size, and why."""

    name: str
    dtype: str
    group_size: int | None
    reason: str

    @property
    def is_quantized(self) -> bool:
        return self.group_size is not None


@dataclass(frozen=True, slots=True)
class QuantProfile:
    """An ordered rule list; the first rule matching a tensor's name decides its scheme."""

    name: str
    rules: tuple[Rule, ...]

    def decide(self, name: str, shape: tuple[int, ...], source_dtype: str) -> Decision:
        """The dtype for tensor `name` of `shape`, now held as float `source_dtype` (f32|f16|bf16)."""
        rule = next((r for r in self.rules if r.matches(name)), None)
        if rule is None:
            return Decision(name, source_dtype, None, "no rule matches; kept as stored")
        if rule.scheme == KEEP_FLOAT:
            return Decision(name, source_dtype, None, f"rule {rule.pattern!r} keeps it float")
        scheme = SCHEMES[rule.scheme]
        if not scheme.is_quantized:
            return Decision(name, scheme.dtype, None, f"rule {rule.pattern!r} stores it as {scheme.name}")
        if len(shape) != 2 or not name.endswith(".weight"):
            return Decision(
                name,
                source_dtype,
                None,
                f"rule {rule.pattern!r} asks {scheme.name}, but only 2-D .weight tensors are quantized; kept float",
            )
        # A rule's own group size is a demand; the scheme's default may step down to one that divides.
        sizes = (
            [rule.group_size]
            if rule.group_size
            else [g for g in sorted(GROUP_SIZES, reverse=True) if g <= scheme.group_size]
        )
        group_size = next((g for g in sizes if shape[1] % g == 0), None)
        if group_size is None:
            return Decision(
                name,
                source_dtype,
                None,
                f"rule {rule.pattern!r} asks {scheme.name}, but input dim {shape[1]} is not a multiple of group size "
                f"{sizes[-1]}; kept float",
            )
        return Decision(name, scheme.dtype, group_size, f"rule {rule.pattern!r}: {scheme.name}, group {group_size}")

    def to_json(self) -> dict[str, Any]:
        """The profile as stored in a `.base` header's `quant_profile` (and as a profile file)."""
        return {"name": self.name, "rules": [r.to_json() for r in self.rules]}


# q-bits one step up for the tensors that hurt most when coarse (value and down projections).
_MIXED_UP = {2: "q4", 3: "q5", 4: "q6", 5: "q6", 6: "q8", 8: "q8"}
# Norms, MoE routers (Qwen3-MoE's `mlp.gate`, Mixtral's `block_sparse_moe.gate`, gpt-oss's `mlp.router`),
# a classifier's head (`score`: a row or two per label, which alone decide the ranking a reranker gives),
# and a vision-language model's vision tower and projector: small beside the decoder, sensitive to
# rounding, and holding arrays no quantized layer takes (position embeddings, a bare projection matrix).
_FLOAT_RULES = (
    Rule("*norm*", KEEP_FLOAT),
    Rule("score.weight", KEEP_FLOAT),
    Rule("*vision_tower.*", KEEP_FLOAT),
    Rule("*multi_modal_projector.*", KEEP_FLOAT),
    Rule("*vision_model.*", KEEP_FLOAT),
    Rule("*connector.*", KEEP_FLOAT),
    Rule("*visual.*", KEEP_FLOAT),
    Rule("*.mlp.gate.weight", KEEP_FLOAT),
    Rule("*.block_sparse_moe.gate.weight", KEEP_FLOAT),
    Rule("*.mlp.router.weight", KEEP_FLOAT),
)
_EMBEDDING_RULES = (Rule("*embed_tokens.weight", "q8"), Rule("lm_head.weight", "q8"))
BUILTIN_PROFILES = ("default", "mixed")


def builtin_profile(name: str, scheme: str) -> QuantProfile:
    """`default`: `scheme` for the body; norms, routers and a classifier's head float; embeddings and lm_head q8.

    `mixed`: as `default`, with v_proj and down_proj one step finer (q4 body -> q6).
    A float `scheme` (f16/bf16/f32) stores everything in that dtype.
    """
    if scheme not in SCHEMES:
        raise ProfileError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if name not in BUILTIN_PROFILES:
        raise ProfileError(
            f"unknown profile {name!r}; built-in profiles are {', '.join(BUILTIN_PROFILES)}, or give a JSON file"
        )
    bits = SCHEMES[scheme].bits
    if bits is None:
        if name == "mixed":
            raise ProfileError(f"the mixed profile needs a quantized scheme (q2..q8), not {scheme}")
        return QuantProfile(f"default-{scheme}", (Rule("*", scheme),))
    body = (Rule("*", scheme),)
    if name == "mixed":
        up = _MIXED_UP[bits]
        body = (Rule("*.v_proj.weight", up), Rule("*.down_proj.weight", up), *body)
    return QuantProfile(f"{name}-{scheme}", _FLOAT_RULES + _EMBEDDING_RULES + body)


def resolve_profile(spec: str | Path, scheme: str, group_size: int | None = None) -> QuantProfile:
    """A built-in profile by name (`default`, `mixed`), else a profile JSON file.

    `group_size` (32, 64 or 128), when given, is the group size of every quantizing rule that
    does not name its own; the profile's name gets a `-g<size>` suffix.
    """
    if isinstance(spec, str) and spec in BUILTIN_PROFILES:
        profile = builtin_profile(spec, scheme)
    else:
        profile = load_profile(Path(spec))
    if group_size is None:
        return profile
    if group_size not in GROUP_SIZES:
        raise ProfileError(f"group size {group_size} must be 32, 64 or 128")
    rules = tuple(
        Rule(r.pattern, r.scheme, r.group_size or group_size, r.is_regex) if _quantizes(r) else r for r in profile.rules
    )
    return QuantProfile(f"{profile.name}-g{group_size}", rules)


def _quantizes(rule: Rule) -> bool:
    scheme = SCHEMES.get(rule.scheme)
    return scheme is not None and scheme.is_quantized


def load_profile(path: Path) -> QuantProfile:
    """Reads and validates a profile file.

    Its form: `{"name": str, "rules": [{"match"|"regex": str, "scheme": str, "group_size"?: int}]}`.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise ProfileError(f"{path}: the profile is not valid JSON ({exc})") from None
    return profile_from_json(data, origin=str(path))


def profile_from_json(data: Any, origin: str = "profile") -> QuantProfile:
    """A profile from its JSON form, with an error naming the first thing that is wrong."""
    if not isinstance(data, dict) or set(data) - {"name", "rules"} or "rules" not in data:
        raise ProfileError(f"{origin}: a profile is an object with 'rules' (and optionally 'name'), nothing else")
    name = data.get("name", Path(origin).stem)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{origin}: 'name' must be a non-empty string")
    rules = data["rules"]
    if not isinstance(rules, list) or not rules:
        raise ProfileError(f"{origin}: 'rules' must be a non-empty list")
    return QuantProfile(name, tuple(_rule_from_json(rule, f"{origin}: rule {i}") for i, rule in enumerate(rules)))


def _rule_from_json(rule: Any, label: str) -> Rule:
    if not isinstance(rule, dict) or len({"match", "regex"} & set(rule)) != 1:
        raise ProfileError(f"{label} must be an object with exactly one of 'match' (glob) or 'regex'")
    unknown = set(rule) - {"match", "regex", "scheme", "group_size"}
    if unknown:
        raise ProfileError(f"{label} has unknown keys {', '.join(sorted(unknown))}")
    is_regex = "regex" in rule
    pattern = rule["regex" if is_regex else "match"]
    if not isinstance(pattern, str) or not pattern:
        raise ProfileError(f"{label}: the pattern must be a non-empty string")
    if is_regex:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ProfileError(f"{label}: regex {pattern!r} does not compile ({exc})") from None
    scheme = rule.get("scheme")
    if scheme != KEEP_FLOAT and scheme not in SCHEMES:
        raise ProfileError(f"{label}: scheme {scheme!r} is not one of {', '.join([*SCHEMES, KEEP_FLOAT])}")
    group_size = rule.get("group_size")
    if group_size is not None:
        if scheme == KEEP_FLOAT or not SCHEMES[scheme].is_quantized:
            raise ProfileError(f"{label}: group_size applies only to quantized schemes, not {scheme}")
        if type(group_size) is not int or group_size not in GROUP_SIZES:
            raise ProfileError(f"{label}: group_size {group_size!r} must be 32, 64 or 128")
    return Rule(pattern, scheme, group_size, is_regex)


# ---------------------------------------------------------------------------------------------
# Applying a profile


def quantize_tensor(
    name: str, array: np.ndarray | mx.array, profile: QuantProfile, scale_dtype: str = "f16"
) -> tuple[TensorRecord, Decision]:
    """One float tensor stored as `profile` decides."""
    raw, source_dtype = float_numpy(array)
    decision = profile.decide(name, tuple(raw.shape), source_dtype)
    if decision.is_quantized:
        bits = int(decision.dtype.removeprefix("base_q"))
        return quantize(array, bits, decision.group_size, scale_dtype, name), decision
    return TensorRecord.from_array(array, decision.dtype), decision


def widen(record: TensorRecord, bits: int, group_size: int) -> TensorRecord | None:
    """The same values as a quantized `record` on a grid with more bits, exactly: codes shifted
    left by the extra bits, scales divided by 2**extra (biases unchanged). None when that is not
    exact: other group sizes, fewer bits, or a scale that would leave its float format's range."""
    if record.bits is None or group_size != record.group_size or bits < record.bits:
        return None
    shift = bits - record.bits
    scales = record.scales
    if shift:
        kind = np.float32 if record.scale_dtype == "f32" else np.float16
        if record.scale_dtype not in ("f32", "f16"):
            return None
        divided = (scales.view(kind) / kind(2**shift)).astype(kind)
        if not np.array_equal(divided * kind(2**shift), scales.view(kind)):
            return None  # subnormal: the division would round
        scales = divided.view(scales.dtype)
    codes = pack_codes(unpack_codes(record.codes, record.bits).astype(np.uint32) << np.uint32(shift), bits)
    return TensorRecord(
        dtype=f"base_q{bits}",
        shape=record.shape,
        codes=codes,
        scales=np.ascontiguousarray(scales),
        biases=record.biases,
        group_size=group_size,
        scale_dtype=record.scale_dtype,
    )


def dequantize_record(record: TensorRecord) -> mx.array:
    """A record as MLX float values: float records as stored, quantized ones dequantized in f32."""
    if record.block_type is not None:
        return mx.array(gguf_blocks.dequantize(record.dtype, record.data, record.shape))
    if record.bits is None:
        values = mx.array(record.data)
        return values.view(mx.bfloat16) if record.dtype == "bf16" else values
    scales = mx.array(record.scales)
    biases = mx.array(record.biases)
    if record.scale_dtype == "bf16":
        scales, biases = scales.view(mx.bfloat16), biases.view(mx.bfloat16)
    return mx.dequantize(
        mx.array(record.codes),
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=record.group_size,
        bits=record.bits,
    )  # (out, in) float32


def requantize_note(label: str, source_quant: str, quant: str) -> None:
    """The one line that says a quantized source is being rounded a second time."""
    log.warning("%s: requantizing its %s weights to %s compounds the two rounding errors", label, source_quant, quant)


def quantize_tensors(
    tensors: Iterable[tuple[str, np.ndarray | mx.array]],
    profile: QuantProfile,
    scale_dtype: str = "f16",
    decisions: list[Decision] | None = None,
) -> Iterator[tuple[str, TensorRecord]]:
    """Lazily quantizes a stream of named float tensors (feed it to `write_base_file`).

    Each decision is appended to `decisions` when given, so callers can report what stayed float.
    """
    for name, array in tensors:
        record, decision = quantize_tensor(name, array, profile, scale_dtype)
        if decisions is not None:
            decisions.append(decision)
        yield name, record
