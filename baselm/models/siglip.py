"""SigLIP's vision transformer (HF `siglip_vision_model`): the image encoder of Gemma 3 and Idefics3.

Patches of `patch_size` pixels are embedded by one linear map (the checkpoint's stride-`patch_size`
convolution, kept in its (hidden, channels, patch, patch) shape), a learned position embedding is
added, and pre-norm blocks of full (two-way) attention and a GELU MLP follow, with a final
LayerNorm. It runs on one image at a time, on dense arrays: no KV cache, no paging. On the CPU its
attention, LayerNorms and GELU run through the CPU kernels (dense_attention.py, cpu/fused.py); the
matmuls are BLAS's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from baselm.cpu import fused
from baselm.dense_attention import dense_attention
from baselm.models.base import BaseModelArgs, ModelConfigError
from baselm.models.mlp import activation
from baselm.models.norm import LayerNorm


@dataclass
class VisionArgs(BaseModelArgs):
    """The keys of HF's SiglipVisionConfig, with its defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def validate(self) -> None:
        if self.image_size % self.patch_size or self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"vision_config: image_size {self.image_size} must be a multiple of patch_size {self.patch_size}, "
                f"and hidden_size {self.hidden_size} of num_attention_heads {self.num_attention_heads}"
            )
        activation(self.hidden_act)


class PatchEmbeddings(nn.Module):
    """Pixels (channels, height, width) -> (num_patches, hidden), patches in row-major order, plus positions."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.patch_size = args.patch_size
        self.patch_embedding = {
            "weight": mx.zeros((args.hidden_size, args.num_channels, args.patch_size, args.patch_size)),
            "bias": mx.zeros((args.hidden_size,)),
        }
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        p = self.patch_size
        channels, height, width = pixels.shape
        patches = pixels.reshape(channels, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4)
        patches = patches.reshape((height // p) * (width // p), channels * p * p)  # (num_patches, c * p * p)
        weight = self.patch_embedding["weight"]
        h = patches @ weight.reshape(weight.shape[0], -1).T + self.patch_embedding["bias"]  # (num_patches, hidden)
        return h + self.position_embedding.weight[: h.shape[0]]


class EncoderAttention(nn.Module):
    """Multi-head attention of every patch over every patch, with biased projections."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        """x: (num_patches, hidden) -> (num_patches, hidden)."""
        n, hidden = x.shape
        head_dim = hidden // self.num_heads
        q, k, v = (p(x).reshape(n, self.num_heads, head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = dense_attention(q, k, v, head_dim**-0.5)  # (n, heads, head_dim)
        return self.out_proj(out.reshape(n, hidden))


class EncoderMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)
        self.act_name = args.hidden_act

    def __call__(self, x: mx.array) -> mx.array:
        h = self.fc1(x)
        out = fused.activation(h, self.act_name)
        return self.fc2(self.act(h) if out is None else out)


class EncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layer_norm1 = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = EncoderAttention(args.hidden_size, args.num_attention_heads)
        self.layer_norm2 = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = EncoderMLP(args)

    def __call__(self, x: mx.array) -> mx.array:
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class VisionTransformer(nn.Module):
    """HF's `SiglipVisionTransformer` (names as its checkpoints give them, under `vision_model.`)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = PatchEmbeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        """pixels: (channels, image_size, image_size) -> (num_patches, hidden), after the final norm."""
        h = self.embeddings(pixels.astype(self.post_layernorm.weight.dtype))
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class VisionModel(nn.Module):
    """HF's `SiglipVisionModel`: the transformer under `vision_model`, without the pooling head."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.vision_model = VisionTransformer(args)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.vision_model(pixels)
