"""A vision tower in an mmproj GGUF, as llama.cpp's mtmd reads it, mapped back to an HF vision-language
checkpoint beside the language model's GGUF.

llama.cpp's converter writes a vision-language model as two files: the language model (a GGUF like
any other: `gemma3`, `llama` for SmolVLM, `qwen2vl` for Qwen2.5-VL) and the tower with its
projector (`general.architecture` "clip", `clip.*` keys, tensors `v.*` and `mm.*`). The keys are
those of `tools/mtmd/clip-impl.h`; the tensor names those of `gguf-py/gguf/tensor_mapping.py`, with
what the converter changes undone here:

- Gemma 3 (`clip.projector_type` "gemma3"): SigLIP under `v.`, the projector's `mm.input_projection`
  (HF's bare `mm_input_projection_weight`) and `mm.soft_emb_norm`, stored as 1 + w. Its tokens per
  image follow from `clip.vision.projector.scale_factor` (patches per side over tokens per side; 4
  when absent, as mtmd assumes).
- SmolVLM / Idefics3 ("idefics3"): SigLIP under `v.`, the connector's projection `mm.model.fc`,
  `clip.vision.projector.scale_factor` its pixel shuffle, `clip.vision.preproc_image_size` the
  longest edge an image is resized to before it is tiled.
- Qwen2.5-VL ("qwen2.5vl_merger"): the fused qkv split into `attn_q`/`attn_k`/`attn_v` (joined
  again here), the Conv3d patch embedding split into its two temporal slices `v.patch_embd.weight`
  and `.weight.1` (stacked again), the merger's norm `v.post_ln` and MLP `mm.0`/`mm.2`; full
  attention every `clip.vision.n_wa_pattern`-th block, windows of `clip.vision.window_size` pixels
  (112 when absent). An image's pixel budget is `clip.vision.image_min_pixels`/`image_max_pixels`
  when the file has them, else mtmd's 8 to 4096 tokens.

The image mean and std are the file's (`clip.vision.image_mean`/`image_std`); the rest of the
preprocessing is transformers' processor for the family (baselm/vision), as for an HF folder.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from baselm.store.base_format import to_float32
from baselm.store.base_writer import TensorRecord
from baselm.store.errors import ModelFileError, UnsupportedModelError
from baselm.store.gguf import GGUFFile
from baselm.store.gguf_affine import record_arrays
from baselm.store.quantize import dequantize_record

# clip.projector_type -> the HF model_type of the whole model, and its image placeholder token
PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3", "qwen2.5vl_merger": "qwen2_5_vl"}
IMAGE_TOKENS = {"gemma3": "<image_soft_token>", "idefics3": "<image>", "qwen2_5_vl": "<|image_pad|>"}
# GGUF block stem -> HF name within a SigLIP encoder layer / a Qwen2.5-VL block
SIGLIP_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
QWEN_LAYER = {
    "ln1": "norm1",
    "ln2": "norm2",
    "attn_out": "attn.proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SIGLIP_GLOBAL = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
QWEN_GLOBAL = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}
# Where each family's tower sits among the HF checkpoint's names
TOWER_PREFIX = {"gemma3": "vision_tower.vision_model.", "idefics3": "model.vision_model.", "qwen2_5_vl": "visual."}
PROJECTOR_TENSORS = {
    "gemma3": {
        "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
        "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
    },
    "idefics3": {"mm.model.fc.weight": "model.connector.modality_projection.proj.weight"},
    "qwen2_5_vl": {},
}
QKV = ("attn_q", "attn_k", "attn_v")
QWEN_PATCH = ("v.patch_embd.weight", "v.patch_embd.weight.1")
_BLOCK = re.compile(r"v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")  # fullmatched
MTMD_QWEN_TOKENS = (8, 4096)  # mtmd's image token limits for Qwen2.5-VL files that give no pixel budget


class Mmproj:
    """An opened mmproj GGUF: its projector family, and its tensors under HF names."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        metadata, name = gguf_file.metadata, gguf_file.path.name
        if metadata.get("general.architecture") != "clip":
            raise ModelFileError(
                f"{name} is not a vision projector (its general.architecture is "
                f"{metadata.get('general.architecture')!r}, an mmproj file's is 'clip')"
            )
        if not metadata.get("clip.has_vision_encoder"):
            raise UnsupportedModelError(f"{name} has no vision encoder (audio projectors are not supported)")
        projector = metadata.get("clip.vision.projector_type") or metadata.get("clip.projector_type")
        if projector not in PROJECTORS:
            raise UnsupportedModelError(
                f"{name}: projector type {projector!r} is not supported (supported: {', '.join(PROJECTORS)})"
            )
        gguf_file.check_types()
        self.file, self.model_type = gguf_file, PROJECTORS[projector]
        self._placed = {gguf_name: self._hf_name(gguf_name) for gguf_name in gguf_file.tensors}

    @classmethod
    def open(cls, path: str | Path) -> Mmproj:
        return cls(GGUFFile.open(path))

    def _key(self, key: str, default: Any = None, required: bool = True) -> Any:
        value = self.file.metadata.get(key, default)
        if value is None and required:
            raise ModelFileError(f"{self.file.path.name} lacks {key}, which a {self.model_type} vision tower needs")
        return value

    # ---- the config -----------------------------------------------------------------------

    def model_config(self, text_config: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
        """The HF config of the whole model: the language model's (`text_config`, from its GGUF) as
        its `text_config`, this file's tower, the image token's id in the vocabulary `tokens`, and the
        preprocessing the file gives (`preprocessor_config`)."""
        ids = {token: i for i, token in enumerate(tokens)}
        image_token = IMAGE_TOKENS[self.model_type]
        if image_token not in ids:
            raise ModelFileError(
                f"the language model's vocabulary lacks {image_token}: {self.file.path.name} is not its projector"
            )
        shared = {k: text_config[k] for k in ("eos_token_id", "bos_token_id", "generation_config") if k in text_config}
        config = {
            **shared,
            "model_type": self.model_type,
            "text_config": text_config,
            "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
            "preprocessor_config": self._preprocessor_config(),
        }
        self._check_width(text_config["hidden_size"])
        if self.model_type == "gemma3":
            return {**config, **self._gemma3_config(ids)}
        if self.model_type == "idefics3":
            return {**config, **self._idefics3_config(ids)}
        return {**config, **self._qwen_config(ids, text_config)}

    def _check_width(self, text_hidden: int) -> None:
        width = self._key("clip.vision.projection_dim", required=False)
        if width is not None and width != text_hidden:
            raise ModelFileError(
                f"{self.file.path.name} projects to {width} features, but the language model's are {text_hidden}: "
                "it is another model's projector"
            )

    def _siglip_config(self) -> dict[str, Any]:
        return {
            "hidden_size": self._key("clip.vision.embedding_length"),
            "intermediate_size": self._key("clip.vision.feed_forward_length"),
            "num_hidden_layers": self._key("clip.vision.block_count"),
            "num_attention_heads": self._key("clip.vision.attention.head_count"),
            "image_size": self._key("clip.vision.image_size"),
            "patch_size": self._key("clip.vision.patch_size"),
            "layer_norm_eps": self._key("clip.vision.attention.layer_norm_epsilon", 1e-6),
            "hidden_act": "gelu_pytorch_tanh",
        }

    def _gemma3_config(self, ids: dict[str, int]) -> dict[str, Any]:
        vision = self._siglip_config()
        scale = self._key("clip.vision.projector.scale_factor", 4)
        per_side = vision["image_size"] // vision["patch_size"] // scale
        markers = [t for t in ("<start_of_image>", "<end_of_image>") if t not in ids]
        if markers:
            raise ModelFileError(f"the language model's vocabulary lacks {markers[0]}: it is not a Gemma 3 with images")
        return {
            "vision_config": vision,
            "mm_tokens_per_image": per_side * per_side,
            "boi_token_index": ids["<start_of_image>"],
            "eoi_token_index": ids["<end_of_image>"],
            "image_token_index": ids["<image_soft_token>"],
        }

    def _idefics3_config(self, ids: dict[str, int]) -> dict[str, Any]:
        return {
            "vision_config": self._siglip_config(),
            "scale_factor": self._key("clip.vision.projector.scale_factor", 2),
            "image_token_id": ids["<image>"],
        }

    def _qwen_config(self, ids: dict[str, int], text_config: dict[str, Any]) -> dict[str, Any]:
        depth = self._key("clip.vision.block_count")
        pattern = self._key("clip.vision.n_wa_pattern")
        vision = {
            "depth": depth,
            "hidden_size": self._key("clip.vision.embedding_length"),
            "intermediate_size": self._key("clip.vision.feed_forward_length"),
            "num_heads": self._key("clip.vision.attention.head_count"),
            "patch_size": self._key("clip.vision.patch_size"),
            "spatial_merge_size": self._key("clip.vision.spatial_merge_size", 2),
            "temporal_patch_size": 2,  # the two slices of the patch embedding (QWEN_PATCH)
            "window_size": self._key("clip.vision.window_size", 112),
            "out_hidden_size": text_config["hidden_size"],
            "fullatt_block_indexes": list(range(pattern - 1, depth, pattern)),
            "hidden_act": "silu",
        }
        return {"vision_config": vision, "image_token_id": ids["<|image_pad|>"]}

    def _preprocessor_config(self) -> dict[str, Any]:
        """transformers' preprocessor_config.json keys for what the file gives."""
        pre = {"image_mean": self._key("clip.vision.image_mean"), "image_std": self._key("clip.vision.image_std")}
        if self.model_type == "idefics3":
            tile = self._key("clip.vision.image_size")
            longest = self._key("clip.vision.preproc_image_size", 4 * tile)
            pre.update(max_image_size={"longest_edge": tile}, size={"longest_edge": longest})
        if self.model_type == "qwen2_5_vl":
            patch, merge = self._key("clip.vision.patch_size"), self._key("clip.vision.spatial_merge_size", 2)
            token_pixels = (patch * merge) ** 2
            low, high = MTMD_QWEN_TOKENS
            pre.update(
                patch_size=patch,
                merge_size=merge,
                temporal_patch_size=2,
                min_pixels=self._key("clip.vision.image_min_pixels", low * token_pixels),
                max_pixels=self._key("clip.vision.image_max_pixels", high * token_pixels),
            )
        return pre

    # ---- the tensors ----------------------------------------------------------------------

    def _hf_name(self, name: str) -> str:
        """The HF name of GGUF tensor `name` (Qwen2.5-VL's q/k/v and patch slices: the joined tensor's)."""
        kind = self.model_type
        if name in PROJECTOR_TENSORS[kind]:
            return PROJECTOR_TENSORS[kind][name]
        prefix = TOWER_PREFIX[kind]
        if kind == "qwen2_5_vl" and name in QWEN_PATCH:
            return prefix + "patch_embed.proj.weight"
        match = _BLOCK.fullmatch(name)
        if match is not None:
            layer, stem, suffix = match.groups()
            if kind == "qwen2_5_vl":
                target = "attn.qkv" if stem in QKV else QWEN_LAYER.get(stem)
                return f"{prefix}blocks.{layer}.{target}.{suffix}" if target else self._unknown(name)
            target = SIGLIP_LAYER.get(stem)
            return f"{prefix}encoder.layers.{layer}.{target}.{suffix}" if target else self._unknown(name)
        stem, _, suffix = name.rpartition(".")
        table = QWEN_GLOBAL if kind == "qwen2_5_vl" else SIGLIP_GLOBAL
        return f"{prefix}{table[stem]}.{suffix}" if stem in table else self._unknown(name)

    def _unknown(self, name: str) -> str:
        where = f"{self.file.path.name}: tensor {name!r}"
        raise UnsupportedModelError(f"{where} has no known place in a {self.model_type} model's vision tower")

    def records(self) -> Iterator[tuple[str, str, TensorRecord]]:
        """(HF name, GGUF type, record) of each HF tensor, sorted by name: GGUF records as they are where
        the converter only renamed them, float32 values (type "F32") where it changed them."""
        by_hf: dict[str, list[str]] = {}
        for gguf_name, hf_name in self._placed.items():
            by_hf.setdefault(hf_name, []).append(gguf_name)
        for hf_name in sorted(by_hf):
            parts = sorted(by_hf[hf_name], key=_part_order)
            if len(parts) == 1 and not hf_name.endswith("mm_soft_emb_norm.weight"):
                info = self.file.tensors[parts[0]]
                yield hf_name, info.type_name, self.file.read(info)
                continue
            yield hf_name, "F32", TensorRecord.from_array(self._joined(hf_name, parts))

    def _joined(self, hf_name: str, parts: list[str]) -> np.ndarray:
        """float32 values of an HF tensor the converter changed: q, k, v one under the other, the
        patch embedding's two temporal slices stacked, Gemma's 1 + w norm less its one."""
        values = [self._float32(p) for p in parts]
        if hf_name.endswith("mm_soft_emb_norm.weight"):
            return values[0] - np.float32(1)
        if hf_name.endswith("patch_embed.proj.weight"):
            if len(values) != 2:
                raise ModelFileError(f"{self.file.path.name} lacks one of {', '.join(QWEN_PATCH)}")
            return np.ascontiguousarray(np.stack(values, axis=2))  # (hidden, channels, 2, patch, patch)
        if len(values) != 3:
            raise ModelFileError(f"{self.file.path.name}: {hf_name} needs its attn_q, attn_k and attn_v tensors")
        return np.ascontiguousarray(np.concatenate(values, axis=0))

    def _float32(self, name: str) -> np.ndarray:
        info = self.file.tensors[name]
        record = self.file.read(info, inexact_as_float=True)
        if record.bits is None and record.block_type is None:
            return to_float32(record.data, record.dtype).reshape(info.shape)
        return np.array(dequantize_record(record).astype(mx.float32)).reshape(info.shape)

    def mx_weights(self) -> dict[str, mx.array]:
        """Every tensor as MLX arrays under its HF name (a quantized one as its triplet)."""
        weights: dict[str, mx.array] = {}
        for name, _, record in self.records():
            weights.update(record_arrays(name, record))
        return weights


def _part_order(name: str) -> tuple[int, str]:
    """q, k, v in that order, and the patch embedding's first slice before `.weight.1`."""
    for i, stem in enumerate(QKV):
        if f".{stem}." in name:
            return i, name
    return 0, name
