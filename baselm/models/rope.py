"""Rotary position embeddings: the RoPE module and the HF rope types (default, linear, dynamic, llama3, yarn,
longrope), resolved from a config's rope dict."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from baselm.cpu import fused
from baselm.models.base import ModelConfigError


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    inv_freq: np.ndarray, dims: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between; and the cos/sin scale."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

    def dim_for(rotations: float) -> float:
        return dims * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low if high != low else 1e-3), 0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    mscale = scaling.get("attention_factor")
    if mscale is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return inv, mscale


def _longrope_freqs(
    dims: int, base: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Short and long per-dimension periods and the cos/sin scale of LongRoPE (Phi-3)."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    freqs = []
    for key in ("short_factor", "long_factor"):
        ext = np.asarray(scaling[key], dtype=np.float64)
        if ext.shape != periods.shape:
            raise ModelConfigError(f"longrope {key} has {ext.size} values, but {dims} rotary dims need {periods.size}")
        freqs.append(ext * periods)
    return freqs[0], freqs[1], old_len, mscale


class RoPE(nn.Module):
    """Rotary embedding at arbitrary per-token positions (HF "rotate half" layout by default).

    Supports rope types default, linear, dynamic (as default within the trained length),
    llama3, yarn and longrope. Positions come per token, so sequences of a batch need not align.
    `dims` below the head size rotates only the first `dims` features (partial rotary).
    """

    def __init__(
        self,
        dims: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        traditional: bool = False,
        max_position_embeddings: int = 4096,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = 1.0
        self._long_freqs = None
        inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
        kind = rope_type(scaling)
        try:
            inv_freq = self._scaled(kind, inv_freq, dims, base, scaling, max_position_embeddings)
        except KeyError as exc:
            raise ModelConfigError(f"rope type {kind!r} needs {exc.args[0]!r} in the config's rope scaling") from None
        self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))  # (dims // 2,) periods / 2pi

    def _scaled(
        self, kind: str, inv_freq: np.ndarray, dims: int, base: float, scaling: Any, max_position_embeddings: int
    ) -> np.ndarray:
        """inv_freq after the scaling of rope type `kind`; sets the cos/sin scale and long factors it implies."""
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.mscale = _yarn_inv_freq(inv_freq, dims, base, scaling, max_position_embeddings)
        elif kind == "longrope":
            short, long, self._long_from, self.mscale = _longrope_freqs(dims, base, scaling, max_position_embeddings)
            inv_freq = 1.0 / short
            self._long_freqs = mx.array(long.astype(np.float32))  # (dims // 2,)
        elif kind not in ("default", "dynamic"):
            raise ModelConfigError(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        return inv_freq

    def divide_frequencies(self, factors: mx.array) -> None:
        """Divides each rotary frequency by its factor, (dims // 2,): llama 3 scaling as GGUF stores it."""
        if factors.shape != self._freqs.shape:
            raise ModelConfigError(
                f"rope_freqs has {factors.size} factors, but {self.dims} rotary dims need {self._freqs.size}"
            )
        self._freqs = self._freqs * factors.astype(mx.float32)

    def _rotate(self, x: mx.array, positions: mx.array, freqs: mx.array) -> mx.array:
        # Each token is its own batch entry with a length-1 sequence at offset = its position.
        return mx.fast.rope(
            x[:, :, None, :],
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=positions,
            freqs=freqs,
        )[:, :, 0, :]

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x: (num_tokens, heads, head_dim); positions: (num_tokens,)."""
        if self._long_freqs is None:
            out = fused.rope(x, positions, self._freqs, self.dims, self.traditional, self.mscale)
            if out is not None:
                return out
        out = self._rotate(x, positions, self._freqs)
        if self._long_freqs is not None:
            # NOTE: LongRoPE switches to its long factors past the trained length. HF decides per
            # forward call (by the largest position); here each token decides by its own position,
            # which agrees with HF whenever a call's positions all lie on one side of that length.
            is_long = (positions >= self._long_from)[:, None, None]
            out = mx.where(is_long, self._rotate(x, positions, self._long_freqs), out)
        if self.mscale != 1.0:
            rotated = out[..., : self.dims] * self.mscale
            out = rotated if self.dims == out.shape[-1] else mx.concatenate([rotated, out[..., self.dims :]], -1)
        return out


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(params: dict[str, Any] | None) -> str:
    """The rope type of an HF rope dict (`rope_type`, or the older `type`; "su" is longrope's old name)."""
    kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind


def make_rope(head_dim: int, params: dict[str, Any], max_position_embeddings: int) -> RoPE:
    """RoPE from a resolved HF rope dict: `rope_theta`, optional `partial_rotary_factor` and scaling keys."""
    dims = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dims % 2 or not 0 < dims <= head_dim:
        raise ModelConfigError(
            f"partial_rotary_factor gives {dims} rotary dims for head_dim {head_dim}; need an even count"
        )
    return RoPE(dims, params["rope_theta"], params, max_position_embeddings=max_position_embeddings)


class MRoPE(RoPE):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the rotary frequencies in three sections (`sections`,
    summing to dims // 2) turned by a token's temporal, height and width positions.

    Positions come as (3, num_tokens), or (num_tokens,) when the three are equal (text, and every
    decode step), where this is plain RoPE. Three rotations, each with the other sections'
    frequencies at zero, make the sectioned one exactly: a zero frequency turns by cos 0 = 1, sin 0 = 0.
    """

    def __init__(self, dims: int, base: float, sections: list[int], max_position_embeddings: int = 4096):
        super().__init__(dims, base, max_position_embeddings=max_position_embeddings)
        if len(sections) != 3 or sum(sections) != dims // 2 or min(sections) < 0:
            raise ModelConfigError(f"mrope_section {sections} must be three counts summing to {dims // 2}")
        periods, index = np.array(self._freqs), np.arange(dims // 2)  # (dims // 2,)
        bounds = np.cumsum([0, *sections])
        self._section_freqs = [  # an infinite period: a zero frequency
            mx.array(np.where((index >= a) & (index < b), periods, np.inf).astype(np.float32))
            for a, b in zip(bounds, bounds[1:])
        ]

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x: (num_tokens, heads, head_dim); positions: (3, num_tokens) or (num_tokens,)."""
        if positions.ndim == 1:
            return super().__call__(x, positions)
        for rows, freqs in zip(positions, self._section_freqs):
            out = fused.rope(x, rows, freqs, self.dims, self.traditional, 1.0)
            x = self._rotate(x, rows, freqs) if out is None else out
        return x
