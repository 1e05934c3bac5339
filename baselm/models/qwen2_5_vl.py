"""Qwen2.5-VL (HF `qwen2_5_vl`, Qwen2_5_VLForConditionalGeneration): Qwen2's decoder with M-RoPE, and
a ViT that reads an image at its own size.

The vision tower embeds each patch (the checkpoint's Conv3d over temporal_patch_size x patch x
patch, as one matmul), turns queries and keys by 2D rotary positions (half the frequencies by the
patch's row, half by its column), and attends within windows of window_size pixels (tokens
reordered so each window is contiguous: `dense_attention`'s segments) except in the
`fullatt_block_indexes` blocks, which attend over the whole image. The merger RMS-norms, joins
each 2 x 2 block of patches and projects it through a GELU MLP to one decoder token.

In the decoder, rotary positions have three components (M-RoPE, rope.MRoPE): a text token's are
all its position; an image's tokens share one temporal position and take their row and column
in the merged grid, offset by where the image starts; the text after an image continues from the
largest of them plus one. `rope_positions` computes a prompt's once; tokens after the prompt sit
at their index plus the prompt's delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from baselm.cpu import fused
from baselm.dense_attention import dense_attention
from baselm.models import qwen2
from baselm.models.attention import Attention
from baselm.models.base import BaseModelArgs, ModelConfigError
from baselm.models.mlp import MLP
from baselm.models.norm import RMSNorm
from baselm.models.rope import MRoPE
from baselm.vision.prompt import PromptImage


@dataclass
class VisionArgs(BaseModelArgs):
    """The keys of HF's Qwen2_5_VLVisionConfig, with its defaults."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ModelConfigError(
                f"vision_config: hidden_size {self.hidden_size} must split into {self.num_heads} heads "
                "of a multiple of 4 features"
            )
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ModelConfigError("vision_config: window_size must be a multiple of patch_size * spatial_merge_size")


@dataclass
class ModelArgs(qwen2.ModelArgs):
    """Qwen2's text args (from `text_config`, or the top level of older configs), the M-RoPE sections
    and the vision tower's args."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    vision: VisionArgs = field(init=False)

    default_rope_theta: ClassVar[float] = 1_000_000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if not isinstance(config.get("vision_config"), dict):
            raise ModelConfigError("a qwen2_5_vl config.json needs a vision_config")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {})
        sections = rope.pop("mrope_section", [16, 24, 24])
        if rope.get("rope_type", rope.get("type")) == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        rope.setdefault("rope_theta", text.get("rope_theta", cls.default_rope_theta))
        vision = dict(config["vision_config"])
        vision.setdefault("rope_theta", (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        vision.setdefault("in_channels", vision.get("in_chans", 3))
        merged = {
            **{k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")},
            "rope_parameters": rope,
            "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            "vision_config": vision,
            "mrope_section": list(sections),
        }
        return super().from_dict(merged)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.vision = VisionArgs.from_dict(self.vision_config)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: list[int]) -> mx.array:
        """x: (n, hidden); cos, sin: (n, 1, head_dim); rows within a segment attend to each other."""
        n, hidden = x.shape
        head_dim = hidden // self.num_heads
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.proj(dense_attention(q, k, v, head_dim**-0.5, segments).reshape(n, hidden))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: list[int]) -> mx.array:
        h = x + self.attn(self.norm1(x), cos, sin, segments)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """RMSNorm, each merge block's patches side by side, then Linear -> GELU -> Linear."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        width = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, args.out_hidden_size)]

    def __call__(self, x: mx.array, merge_unit: int) -> mx.array:
        """(n, hidden), blocks of `merge_unit` consecutive patches -> (n / merge_unit, out_hidden)."""
        h = self.mlp[0](self.ln_q(x).reshape(x.shape[0] // merge_unit, -1))
        out = fused.activation(h, "gelu")
        return self.mlp[2](self.mlp[1](h) if out is None else out)


class VisionTransformer(nn.Module):
    """HF's `visual`: patch embedding, blocks of windowed and full attention, the merger."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        shape = (args.hidden_size, args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
        self.patch_embed = {"proj": {"weight": mx.zeros(shape)}}
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)

    def __call__(self, patches: mx.array) -> mx.array:
        """patches (grid_h / m, grid_w / m, m * m, channels * temporal * patch^2), m the merge size ->
        (grid_h * grid_w / m^2, out_hidden) tokens in row-major order of the merged grid."""
        rows, cols, unit, width = patches.shape
        weight = self.patch_embed["proj"]["weight"]
        x = patches.reshape(-1, width).astype(weight.dtype) @ weight.reshape(weight.shape[0], -1).T  # (n, hidden)
        order, windows = window_order(rows, cols, self.args.window_size // self.args.patch_size // int(unit**0.5))
        x = x.reshape(rows * cols, unit, -1)[mx.array(order)].reshape(rows * cols * unit, -1)
        cos, sin = self._rotary(rows, cols, unit, order)
        whole = [0, rows * cols * unit]
        windows = [w * unit for w in windows]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in self.args.fullatt_block_indexes else windows)
        merged = self.merger(x, unit)  # (rows * cols, out_hidden) in window order
        return merged[mx.array(np.argsort(order))]

    def _rotary(self, rows: int, cols: int, unit: int, order: np.ndarray) -> tuple[mx.array, mx.array]:
        """cos, sin (n, 1, head_dim) of each patch, in window order: half the frequencies by its row,
        half by its column (HF's axial rotary)."""
        m, head_dim = int(unit**0.5), self.args.head_dim
        spatial = head_dim // 2
        inv_freq = 1.0 / (self.args.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
        h, w = np.meshgrid(np.arange(rows * m, dtype=np.float32), np.arange(cols * m, dtype=np.float32), indexing="ij")
        h = h.reshape(rows, m, cols, m).transpose(0, 2, 1, 3).reshape(rows * cols, unit)[order].reshape(-1)
        w = w.reshape(rows, m, cols, m).transpose(0, 2, 1, 3).reshape(rows * cols, unit)[order].reshape(-1)
        angles = np.concatenate([h[:, None] * inv_freq, w[:, None] * inv_freq], axis=-1).astype(np.float32)
        angles = np.concatenate([angles, angles], axis=-1)[:, None, :]  # (n, 1, head_dim)
        return mx.array(np.cos(angles)), mx.array(np.sin(angles))


def window_order(rows: int, cols: int, size: int) -> tuple[np.ndarray, list[int]]:
    """The merged tokens of a rows x cols grid window by window (windows of size x size, row-major,
    each window's tokens row-major; edge windows are smaller), and the windows' boundaries."""
    grid = np.arange(rows * cols).reshape(rows, cols)
    order, bounds = [], [0]
    for r in range(0, rows, size):
        for c in range(0, cols, size):
            window = grid[r : r + size, c : c + size].reshape(-1)
            order.append(window)
            bounds.append(bounds[-1] + len(window))
    return np.concatenate(order), bounds


class Model(qwen2.Model):
    """Qwen2's decoder with M-RoPE, and the ViT beside it."""

    position_rows = 3

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.visual = VisionTransformer(args.vision)

    def make_attention(self, args: ModelArgs, layer_idx: int) -> Attention:
        attention = super().make_attention(args, layer_idx)
        theta = args.rope_params(args.layer_types[layer_idx])["rope_theta"]
        attention.rope = MRoPE(args.head_dim, theta, args.mrope_section, args.max_position_embeddings)
        return attention

    def embed_image(self, pixels: mx.array, extra: dict[str, Any]) -> mx.array:
        """patches (grid_h / 2, grid_w / 2, 4, ...) -> (grid_h * grid_w / 4, hidden) tokens, row-major."""
        return self.visual(pixels).astype(self.embed_tokens.weight.dtype)

    def rope_positions(self, num_prompt_tokens: int, images: list[PromptImage]) -> tuple[np.ndarray, int]:
        """(3, num_prompt_tokens) int32 M-RoPE positions of a prompt, and the delta of the tokens after it
        (their position is their index plus it)."""
        table = np.empty((3, num_prompt_tokens), dtype=np.int64)
        at, next_position = 0, 0
        for image in sorted(images, key=lambda i: i.start):
            table[:, at : image.start] = next_position + np.arange(image.start - at)
            next_position += image.start - at
            rows, cols = image.pixels.shape[:2]
            table[0, image.start : image.end] = next_position
            table[1, image.start : image.end] = next_position + np.repeat(np.arange(rows), cols)
            table[2, image.start : image.end] = next_position + np.tile(np.arange(cols), rows)
            next_position += max(rows, cols)
            at = image.end
        table[:, at:] = next_position + np.arange(num_prompt_tokens - at)
        return table.astype(np.int32), int(table.max()) + 1 - num_prompt_tokens

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Both layouts: `model.language_model.*` / `model.visual.*` (transformers 5) and `model.*` /
        `visual.*` (the released checkpoints)."""
        renamed = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            renamed[name.removeprefix("language_model.")] = value
        return super().sanitize(renamed)
