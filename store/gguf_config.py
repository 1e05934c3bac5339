"""A GGUF header as an HF config, checked against its tensors: the metadata's sizes (hidden size,
heads, layers, feed-forward and expert lengths) must fit the tensor table, so a broken or mislabelled
file is a clear error before any weight is read."""

from __future__ import annotations

from typing import Any

from baselm.store.errors import ModelFileError
from baselm.store.gguf_arch import _NAME, CLS_OUT, EXPERT_STEMS, ArchSpec, Meta, arch_spec, common_config


def hf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, Any], ArchSpec, Meta]:
    """(HF config.json equivalent, architecture spec, metadata view) of a GGUF header and tensor table."""
    arch, spec = arch_spec(metadata)
    meta = Meta(arch, metadata, shapes)
    config = {"model_type": spec.model_type, **common_config(meta)}
    if spec.config is not None:
        config.update(spec.config(meta))
    if spec.classifier is not None and meta.has(CLS_OUT):
        config.update(_classifier_config(spec.classifier, meta))
    if config["vocab_size"] is None:
        raise ModelFileError(f"GGUF file has neither {arch}.vocab_size nor a token_embd tensor")
    check_shapes(config, meta)
    return config, spec, meta


def _classifier_config(architecture: str, meta: Meta) -> dict[str, Any]:
    """The config of a file with a classification head: its HF class and its labels, one per row
    (`classifier.output_labels`; llama.cpp reads one row when the file names no labels)."""
    num_rows = meta.shapes[CLS_OUT][0]
    labels = meta.metadata.get(f"{meta.arch}.classifier.output_labels") or [f"LABEL_{i}" for i in range(num_rows)]
    if len(labels) != num_rows:
        raise ModelFileError(
            f"GGUF metadata contradicts its tensors: {len(labels)} classifier labels, but {CLS_OUT} has {num_rows} rows"
        )
    return {"architectures": [architecture], "id2label": {str(i): str(label) for i, label in enumerate(labels)}}


def _expect(meta: Meta, name: str, axis: int, size: int, what: str) -> None:
    shape = meta.shapes.get(name)
    if shape is not None and shape[axis] != size:
        raise ModelFileError(
            f"GGUF metadata contradicts its tensors: {what} gives {size}, but {name} has shape {list(shape)}"
        )


def check_shapes(config: dict[str, Any], meta: Meta) -> None:
    """A clear error when the metadata's sizes disagree with the tensors (a broken or mislabelled file)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_layers = config["num_hidden_layers"]
    _expect(meta, "token_embd.weight", 0, config["vocab_size"], "vocab_size")
    _expect(meta, "token_embd.weight", 1, hidden, "embedding_length")
    layers = {int(m.group(1)) for n in meta.shapes if (m := _NAME.fullmatch(n)) and m.group(1) is not None}
    if layers and max(layers) >= num_layers:
        raise ModelFileError(
            f"GGUF metadata contradicts its tensors: block_count is {num_layers}, but blk.{max(layers)} exists"
        )
    for i in range(num_layers):
        if f"blk.{i}.attn_norm.weight" not in meta.shapes:
            raise ModelFileError(f"GGUF file lacks blk.{i}.attn_norm.weight (block_count is {num_layers})")
        _expect(meta, f"blk.{i}.attn_q.weight", -2, heads * head_dim, f"{heads} heads of {head_dim}")
        _expect(meta, f"blk.{i}.attn_k.weight", -2, kv_heads * head_dim, f"{kv_heads} kv heads of {head_dim}")
        _expect(meta, f"blk.{i}.attn_v.weight", -2, kv_heads * head_dim, f"{kv_heads} kv heads of {head_dim}")
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        _expect(meta, f"blk.{i}.attn_qkv.weight", -2, qkv_rows, f"{heads} + 2 x {kv_heads} heads of {head_dim}")
        for stem in ("attn_q", "attn_k", "attn_v", "attn_qkv"):
            _expect(meta, f"blk.{i}.{stem}.weight", -1, hidden, "embedding_length")
        _check_ffn_shapes(config, meta, i)


def _check_ffn_shapes(config: dict[str, Any], meta: Meta, i: int) -> None:
    """Feed-forward sizes of layer `i` against feed_forward_length and the expert keys."""
    ffn = config["intermediate_size"]
    is_fused = config["model_type"] == "phi3" and f"blk.{i}.ffn_gate.weight" not in meta.shapes
    _expect(meta, f"blk.{i}.ffn_up.weight", -2, 2 * ffn if is_fused else ffn, "feed_forward_length")
    _expect(meta, f"blk.{i}.ffn_gate.weight", -2, ffn, "feed_forward_length")
    _expect(meta, f"blk.{i}.ffn_down.weight", -1, ffn, "feed_forward_length")
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if not num_experts:
        return
    expert_ffn = config.get("moe_intermediate_size") or ffn
    for stem in EXPERT_STEMS:
        _expect(meta, f"blk.{i}.{stem}.weight", 0, num_experts, "expert_count")
    _expect(meta, f"blk.{i}.ffn_gate_exps.weight", 1, expert_ffn, "the expert feed-forward length")
    _expect(meta, f"blk.{i}.ffn_up_exps.weight", 1, expert_ffn, "the expert feed-forward length")
    _expect(meta, f"blk.{i}.ffn_down_exps.weight", 2, expert_ffn, "the expert feed-forward length")
    _expect(meta, f"blk.{i}.ffn_gate_inp.weight", 0, num_experts, "expert_count")
