"""The tiny vision-language fixtures (tests/vision_fixture.py) written as llama.cpp's converter writes
them: a language-model GGUF and an mmproj GGUF, with the `gguf` package.

The language model goes through tests/tiny_gguf.py's converter (names, q/k permutation for llama,
Gemma's `1 + w` norms) under its GGUF architecture (`gemma3`, `llama` for SmolVLM, `qwen2vl` with
M-RoPE's sections), with the fixture's own byte-level BPE vocabulary and chat template. The tower
and projector are renamed by the `gguf` package's own tensor map (`get_tensor_name_map(MMPROJ)`,
the converter's), with the converter's changes: Gemma 3's `mm_input_projection_weight` as
`mm.input_projection.weight` and its soft-embedding norm as 1 + w; Qwen2.5-VL's qkv split into q, k
and v and its Conv3d patch embedding into two temporal slices; and its `clip.*` keys (the
`set_gguf_parameters` of Gemma3VisionModel, SmolVLMModel, Qwen2VLVisionModel; the Qwen2.5-VL fixture's
windows, smaller than every released model's, also as `clip.vision.window_size`, which mtmd reads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.tiny_gguf import add_hparams, converter_tensors, encode, write_gguf
from tests.vision_fixture import VisionFixture

TEXT_TYPES = {"gemma3": "gemma3_text", "idefics3": "llama", "qwen2_5_vl": "qwen2"}
GGUF_ARCHS = {"gemma3": "gemma3", "idefics3": "llama", "qwen2_5_vl": "qwen2vl"}
PROJECTOR_TYPES = {"gemma3": "gemma3", "idefics3": "idefics3", "qwen2_5_vl": "qwen2.5vl_merger"}


def split_checkpoint(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(text tensors under `model.*`/`lm_head`, vision tensors under the released checkpoints' names)."""
    text, vision = {}, {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        for old, new in (("language_model.model.", "model."), ("model.text_model.", "model."), ("language_model.", "")):
            if name.startswith(old):
                name = new + name.removeprefix(old)
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        is_text = name.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head"))
        (text if is_text else vision)[name] = value
    return text, vision


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's HF config, as the converter's text model sees it."""
    text = dict(config["text_config"])
    text["model_type"] = TEXT_TYPES[config["model_type"]]
    text.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def add_vocabulary(writer: gguf.GGUFWriter, folder: Path) -> None:
    """The fixture's byte-level BPE (tokenizer.json) and chat template as GGUF tokenizer keys."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if settings.get(key):
            add(vocab[settings[key]])
    writer.add_chat_template(settings["chat_template"])


def write_language_model(path: Path, fixture: VisionFixture) -> Path:
    config = json.loads((fixture.folder / "config.json").read_text())
    text = text_config(config)
    tensors = converter_tensors(text, split_checkpoint(fixture.folder)[0])
    encoded = {name: (encode(value, "F32"), "F32") for name, value in tensors.items()}
    arch = GGUF_ARCHS[config["model_type"]]

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, text)
        if arch == "gemma3":  # the fixture's own pattern, as a flag per layer
            flags = [t == "sliding_attention" for t in text["layer_types"]]
            writer.add_array(f"{arch}.attention.sliding_window_pattern", flags)
            writer.add_float32(f"{arch}.rope.freq_base_swa", text["rope_parameters"]["sliding_attention"]["rope_theta"])
        if arch == "qwen2vl":
            writer.add_rope_dimension_sections([*text["rope_parameters"]["mrope_section"], 0])
        add_vocabulary(writer, fixture.folder)

    return write_gguf(path, encoded, metadata, arch=arch)


def mmproj_tensors(config: dict[str, Any], vision: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tower and projector under the converter's names, with its changes."""
    depth = config["vision_config"].get("num_hidden_layers") or config["vision_config"]["depth"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, depth)
    out = {}
    for name, value in sorted(vision.items()):
        name = name.replace("_weight", ".weight")  # Gemma 3's bare mm_input_projection_weight
        if "soft_emb_norm" in name:
            value = value + np.float32(1)
        if ".qkv." in name:  # Qwen2.5-VL: split into q, k and v
            for part, piece in zip("qkv", np.split(value, 3, axis=0)):
                out[names.get_name(name.replace("qkv", part), try_suffixes=(".weight", ".bias"))] = piece
            continue
        if "patch_embed.proj.weight" in name:  # Qwen2.5-VL: the Conv3d's two temporal slices
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = value[:, :, 0], value[:, :, 1]
            continue
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = value
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_mmproj(path: Path, fixture: VisionFixture, type_name: str = "F32") -> Path:
    """The fixture's tower and projector as an mmproj GGUF; with `type_name` F16 its matrices in F16
    (the converter's `--outtype f16`: 1-D tensors stay F32)."""
    config = json.loads((fixture.folder / "config.json").read_text())
    kind, vision = config["model_type"], config["vision_config"]
    pre = json.loads((fixture.folder / "preprocessor_config.json").read_text()) if kind != "gemma3" else {}
    tensors = mmproj_tensors(config, split_checkpoint(fixture.folder)[1])
    types = {name: type_name if value.ndim > 1 else "F32" for name, value in tensors.items()}
    encoded = {name: (encode(value, types[name]), types[name]) for name, value in tensors.items()}

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(PROJECTOR_TYPES[kind])
        writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
        writer.add_vision_patch_size(vision["patch_size"])
        writer.add_vision_embedding_length(vision["hidden_size"])
        writer.add_vision_feed_forward_length(vision["intermediate_size"])
        writer.add_vision_block_count(vision.get("num_hidden_layers") or vision["depth"])
        writer.add_vision_head_count(vision.get("num_attention_heads") or vision["num_heads"])
        writer.add_vision_image_mean(pre.get("image_mean", [0.5] * 3))
        writer.add_vision_image_std(pre.get("image_std", [0.5] * 3))
        family_keys(writer, config, pre)

    return write_gguf(path, encoded, metadata, arch="clip")


def family_keys(writer: gguf.GGUFWriter, config: dict[str, Any], pre: dict[str, Any]) -> None:
    """The keys each family's converter class adds."""
    kind, vision = config["model_type"], config["vision_config"]
    if kind == "gemma3":
        writer.add_vision_image_size(vision["image_size"])
        writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
        writer.add_vision_use_gelu(True)
        scale = vision["image_size"] // vision["patch_size"] // int(config["mm_tokens_per_image"] ** 0.5)
        if scale != 4:  # the converter writes it only when it is not the default
            writer.add_vision_projector_scale_factor(scale)
    elif kind == "idefics3":
        writer.add_vision_image_size(vision["image_size"])
        writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-5))
        writer.add_vision_projector_scale_factor(config.get("scale_factor", 2))
        writer.add_vision_use_gelu(True)
        writer.add_vision_preproc_image_size(pre["size"]["longest_edge"])
    else:
        writer.add_vision_image_size(vision.get("image_size", 560))
        writer.add_vision_use_silu(True)
        indexes = vision["fullatt_block_indexes"]
        writer.add_vision_n_wa_pattern(indexes[0] + 1)
        if vision["window_size"] != 112:  # the converter leaves it out: every released model's is mtmd's 112
            writer.add_vision_window_size(vision["window_size"])
        writer.add_vision_attention_layernorm_eps(config.get("rms_norm_eps", 1e-6))


def write_vision_gguf(folder: Path, fixture: VisionFixture) -> tuple[Path, Path]:
    """(language model GGUF, mmproj GGUF) of `fixture`, written into `folder`."""
    return (
        write_language_model(folder / f"{fixture.name}-F32.gguf", fixture),
        write_mmproj(folder / f"mmproj-{fixture.name}-F32.gguf", fixture),
    )
