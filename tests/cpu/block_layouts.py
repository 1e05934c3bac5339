"""GGUF blocks parsed in numpy from ggml's layouts (block_q4_0 ... block_q8_0, block_iq4_nl, block_q2_K
... block_q6_K, block_iq4_xs), not through the kernels or the gguf package: the oracle the block kernel
tests (test_block_kernels.py) check the integer path against.
"""

from __future__ import annotations

import numpy as np

from baselm import gguf_blocks

KINDS = [t.suffix for t in gguf_blocks.BLOCK_TYPES]  # q4_0 ... q8_0, iq4_nl, q2_k ... q6_k, iq4_xs
BLOCK = 32  # values an activation code block (and a legacy block, a Q4_K/Q5_K sub-block) holds
SUPER = gguf_blocks.SUPER_BLOCK


def is_kquant(kind: str) -> bool:
    return gguf_blocks.BY_SUFFIX[kind].is_kquant


# Byte ranges of one block (ggml's block_q4_0 ... block_q8_0, block_iq4_nl, block_q2_K ... block_q6_K,
# block_iq4_xs).
FIELDS = {
    "q4_0": {"d": slice(0, 2), "qs": slice(2, 18)},
    "q4_1": {"d": slice(0, 2), "m": slice(2, 4), "qs": slice(4, 20)},
    "q5_0": {"d": slice(0, 2), "qh": slice(2, 6), "qs": slice(6, 22)},
    "q5_1": {"d": slice(0, 2), "m": slice(2, 4), "qh": slice(4, 8), "qs": slice(8, 24)},
    "q8_0": {"d": slice(0, 2), "qs": slice(2, 34)},
    "q4_k": {"d": slice(0, 2), "dmin": slice(2, 4), "scales": slice(4, 16), "qs": slice(16, 144)},
    "q5_k": {"d": slice(0, 2), "dmin": slice(2, 4), "scales": slice(4, 16), "qh": slice(16, 48), "qs": slice(48, 176)},
    "q6_k": {"ql": slice(0, 128), "qh": slice(128, 192), "scales": slice(192, 208), "d": slice(208, 210)},
    "iq4_nl": {"d": slice(0, 2), "qs": slice(2, 18)},
    "q2_k": {"scales": slice(0, 16), "qs": slice(16, 80), "d": slice(80, 82), "dmin": slice(82, 84)},
    "q3_k": {"hmask": slice(0, 32), "qs": slice(32, 96), "scales": slice(96, 108), "d": slice(108, 110)},
    "iq4_xs": {"d": slice(0, 2), "scales_h": slice(2, 4), "scales": slice(4, 8), "qs": slice(8, 136)},
}
CODE_FIELDS = {kind: tuple(f for f in ("ql", "qh", "hmask", "qs") if f in FIELDS[kind]) for kind in KINDS}
# llama.cpp's kvalues_iq4nl: the levels IQ4_NL's and IQ4_XS's 4-bit codes index.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64)
ZERO_POINT = {"q4_0": 8, "q5_0": 16}  # value d * (q - zero point); the other legacy types: d * q (+ m)


def _field(sb: np.ndarray, kind: str, name: str) -> np.ndarray:
    return sb[..., FIELDS[kind][name]].astype(np.int64)


def _half(sb: np.ndarray, kind: str, name: str) -> np.ndarray:
    return np.ascontiguousarray(sb[..., FIELDS[kind][name]]).view(np.float16)[..., 0].astype(np.float64)


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and min of each of the 8 sub-blocks from 12 packed bytes (ggml's get_scale_min_k4)."""
    q = packed
    sc, mn = np.empty((*q.shape[:-1], 8), np.int64), np.empty((*q.shape[:-1], 8), np.int64)
    for j in range(4):
        sc[..., j], mn[..., j] = q[..., j] & 63, q[..., j + 4] & 63
    for j in range(4, 8):
        sc[..., j] = (q[..., j + 4] & 15) | ((q[..., j - 4] >> 6) << 4)
        mn[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
    return sc, mn


def _codes_q45(sb: np.ndarray, kind: str) -> np.ndarray:
    """(rows, supers, 256) Q4_K/Q5_K codes: 64 values a chunk of 32 qs bytes, low nibbles (sub-block
    2c) then high (2c + 1); Q5_K's fifth bit of value l in sub-block b is bit b of qh[l]."""
    v = np.arange(SUPER)
    sub, lane = v // BLOCK, v % BLOCK
    qs = _field(sb, kind, "qs")[..., BLOCK * (sub // 2) + lane]
    codes = (qs >> (4 * (sub % 2))) & 15
    if kind == "q5_k":
        codes |= ((_field(sb, kind, "qh")[..., lane] >> sub) & 1) << 4
    return codes


def _codes_q6(sb: np.ndarray) -> np.ndarray:
    """(rows, supers, 256) Q6_K codes q - 32: per 128 values, value 32i + l has the low (i < 2) or
    high nibble of ql[l + 32 (i % 2)] and bits 2i, 2i + 1 of qh[l] (ggml's dequantize_row_q6_K)."""
    v = np.arange(SUPER)
    half, quarter, lane = v // 128, (v % 128) // 32, v % 32
    ql = _field(sb, "q6_k", "ql")[..., 64 * half + lane + 32 * (quarter % 2)]
    qh = _field(sb, "q6_k", "qh")[..., 32 * half + lane]
    return (((ql >> (4 * (quarter // 2))) & 15) | (((qh >> (2 * quarter)) & 3) << 4)) - 32


def _codes_2bit(sb: np.ndarray, kind: str) -> np.ndarray:
    """(rows, supers, 256) Q2_K/Q3_K 2-bit codes: value 32i + l in bits 2 (i % 4) of qs[32 (i // 4) + l]
    (ggml's dequantize_row_q2_K, q3_K)."""
    v = np.arange(SUPER)
    sub, lane = v // BLOCK, v % BLOCK
    return (_field(sb, kind, "qs")[..., BLOCK * (sub // 4) + lane] >> (2 * (sub % 4))) & 3


def _codes_q3(sb: np.ndarray) -> np.ndarray:
    """(rows, supers, 256) Q3_K codes q - 4: 2 bits as Q2_K's, the third bit i of hmask[l] for value 32i + l."""
    v = np.arange(SUPER)
    high = (_field(sb, "q3_k", "hmask")[..., v % BLOCK] >> (v // BLOCK)) & 1
    return _codes_2bit(sb, "q3_k") + 4 * high - 4


def _scales_q3(sb: np.ndarray) -> np.ndarray:
    """(rows, supers, 16) Q3_K's 6-bit scales less 32: scale i's low 4 bits the low (i < 8) or high nibble
    of byte i % 8, its top 2 bits bits 2 (i // 4) of byte 8 + i % 4 (ggml's kmask1/kmask2 unpacking)."""
    packed, i = _field(sb, "q3_k", "scales"), np.arange(16)
    low = (packed[..., i % 8] >> (4 * (i // 8))) & 15
    return (low | ((packed[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4) - 32


def _iq4_codes(nibbles: np.ndarray) -> np.ndarray:
    """(..., 32) IQ4 levels of blocks of 16 nibble bytes (..., 16): byte l's low nibble value l, high l + 16."""
    return IQ4_LEVELS[np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)]


def _scales_iq4xs(sb: np.ndarray) -> np.ndarray:
    """(rows, supers, 8) IQ4_XS block scales ls - 32: nibble j % 2 of scales_l[j // 2], bits 2j, 2j + 1 of
    the little-endian u16 scales_h above it (ggml's dequantize_row_iq4_xs)."""
    high = _field(sb, "iq4_xs", "scales_h")
    high = high[..., 0] | high[..., 1] << 8
    j = np.arange(8)
    low = (_field(sb, "iq4_xs", "scales")[..., j // 2] >> (4 * (j % 2))) & 15
    return (low | ((high[..., None] >> (2 * j)) & 3) << 4) - 32


def _parse_legacy(kind: str, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """parse() of legacy blocks: codes q (Q8_0's signed, IQ4_NL's levels), scales d, offsets m (Q4_1,
    Q5_1), -8d (Q4_0), -16d (Q5_0) or 0 (Q8_0, IQ4_NL). Nibble byte l holds value l (low) and l + 16
    (high); bit l of the little-endian u32 qh is bit 4 of value l (ggml's dequantize_row_q4_0 ... q8_0)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // BLOCK, gguf_blocks.BY_SUFFIX[kind].block_bytes)
    d = _half(blocks, kind, "d")
    if kind == "q8_0":
        codes = np.ascontiguousarray(blocks[..., FIELDS[kind]["qs"]]).view(np.int8).astype(np.int64)
        return codes.astype(np.float64), d, np.zeros_like(d)
    qs = _field(blocks, kind, "qs")  # (rows, n, 16)
    if kind == "iq4_nl":
        return _iq4_codes(qs).astype(np.float64), d, np.zeros_like(d)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if "qh" in FIELDS[kind]:
        lane = np.arange(BLOCK)
        codes |= ((_field(blocks, kind, "qh")[..., lane // 8] >> (lane % 8)) & 1) << 4
    offsets = _half(blocks, kind, "m") if "m" in FIELDS[kind] else -ZERO_POINT[kind] * d
    return codes.astype(np.float64), d, offsets


def _parse_super(kind: str, sb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes (rows, supers, 256), scales (rows, supers, groups), offsets per 32 or None, minimums per 16
    or None) of super-blocks sb (rows, supers, bytes)."""
    rows, supers = sb.shape[:2]
    d = _half(sb, kind, "d")[..., None]
    if kind == "q6_k":
        return _codes_q6(sb), d * sb[..., FIELDS[kind]["scales"]].view(np.int8), None, None
    if kind == "q3_k":
        return _codes_q3(sb), d * _scales_q3(sb), None, None
    if kind == "iq4_xs":
        codes = _iq4_codes(_field(sb, kind, "qs").reshape(rows, supers, 8, 16)).reshape(rows, supers, SUPER)
        return codes, d * _scales_iq4xs(sb), None, None
    if kind == "q2_k":
        packed = _field(sb, kind, "scales")  # (rows, supers, 16): scale low nibble, minimum high
        return _codes_2bit(sb, kind), d * (packed & 15), None, -_half(sb, kind, "dmin")[..., None] * (packed >> 4)
    sc, mn = _scales_mins(_field(sb, kind, "scales"))
    return _codes_q45(sb, kind), d * sc, -_half(sb, kind, "dmin")[..., None] * mn, None


def parse(kind: str, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, offsets, minimums) of the blocks, value = code * scale + offset + minimum: codes
    (rows, groups, group) with groups of 32 values (legacy, Q4_K, Q5_K, IQ4_XS) or 16 (Q2_K, Q3_K,
    Q6_K), scales (rows, groups), offsets (rows, cols / 32) and minimums (rows, cols / 16) in float64
    (Q4_K/Q5_K: d * sc and -dmin * m; Q2_K: d * sc and -dmin * m per 16 values; Q3_K: d * (sc - 32);
    Q6_K: d * sc; IQ4_XS: d * (ls - 32); offsets and minimums 0 where the type has none)."""
    rows = raw.shape[0]
    minimums = np.zeros((rows, cols // 16))
    if not is_kquant(kind):
        return (*_parse_legacy(kind, raw, cols), minimums)
    sb = raw.reshape(rows, cols // SUPER, gguf_blocks.BY_SUFFIX[kind].block_bytes)
    codes, scales, offsets, mins = _parse_super(kind, sb)
    offsets = np.zeros((rows, cols // BLOCK)) if offsets is None else offsets.reshape(rows, -1)
    minimums = minimums if mins is None else mins.reshape(rows, -1)
    groups = scales.shape[-1] * (cols // SUPER)
    return codes.reshape(rows, groups, -1).astype(np.float64), scales.reshape(rows, groups), offsets, minimums
