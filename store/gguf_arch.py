"""How llama.cpp lays out each architecture in a GGUF, and how it maps back to an HF checkpoint.

One `ArchSpec` per GGUF `general.architecture` (the table `ARCHS`): the HF `model_type`, tensor
names that differ from the common map, whether llama.cpp permuted the q/k rows, whether norm
weights hold Gemma's `1 + w`, where stacked experts go, and the config keys only that architecture
has. The conventions are those of llama.cpp's `convert_hf_to_gguf.py` (tensor names as in
`gguf-py/gguf/tensor_mapping.py`, metadata keys as in `gguf-py/gguf/constants.py`) and of
`src/llama-model.cpp` for what the file leaves implicit:

- llama (and Mistral, which the converter writes as llama): q/k rows permuted (llama.cpp rotates
  interleaved pairs, HF halves); with `expert_count` it is Mixtral. llama 3 scaling is a
  `rope_freqs` tensor; linear and YaRN scaling are `rope.scaling.*` keys.
- gemma2/gemma3: every `*norm.weight` holds `1 + w` (HF stores `w`); the query scale is
  `1/sqrt(head_dim)`, except for the 27B models (46 and 62 layers), which use
  `1/sqrt(hidden / heads)`; Gemma 2 slides in even layers, Gemma 3 in five of every six (unless a
  `sliding_window_pattern` key gives the period or a flag per layer), its local layers with RoPE
  base 10000 (or `rope.freq_base_swa`) and no scaling. Soft-caps come from `*_logit_softcapping`.
- phi3: fused `attn_qkv` and `ffn_up` (gate then up); LongRoPE factors are the tensors
  `rope_factors_long`/`rope_factors_short`, partial rotary is `rope.dimension_count`.
- qwen2vl (Qwen2-VL, Qwen2.5-VL): qwen2's layout, M-RoPE's sections in `rope.dimension_sections`;
  alone it runs as qwen2 (text), with an mmproj file as the vision-language model (gguf_mmproj.py).
- qwen3moe: stacked `ffn_*_exps` experts and an `ffn_gate_inp` router; llama.cpp always
  renormalizes the top-k weights (`norm_topk_prob`), unless `expert_weights_norm` says otherwise.
- smollm3: llama's layout (q/k rows permuted); llama.cpp skips RoPE in every 4th layer, which
  no key records (HF's `no_rope_layer_interval` 4).
- qwen3 rerankers (Qwen3-Reranker, as the converter writes them): `cls.output.weight` is a
  classification head, (labels, hidden), whose `classifier.output_labels` are ["yes", "no"] (the
  LM head's rows of those two tokens), with `pooling_type` RANK and a `rerank` chat template; the
  untied LM head itself is left out. It becomes HF's `score.weight` of a
  `Qwen3ForSequenceClassification` (`architectures`, `id2label` in the config). llama.cpp reads a
  head in no other decoder architecture (`src/models/qwen3.cpp`), so neither does this reader.
- gpt-oss: attention sinks `attn_sinks`, a router with a bias, `post_attention_norm` as the
  second norm, experts split from HF's fused tensors (store/gguf_gpt_oss.py puts them back), no
  q/k permutation. llama.cpp fixes what no key records: even layers slide, the SwiGLU clamp is 7
  (alpha 1.702); YaRN follows the released HF config (no truncation of its ramp).

Every size the metadata gives is checked against the tensor shapes (`gguf_config.check_shapes`). Adding an
architecture is one `ArchSpec` and, if it has config keys of its own, one function.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baselm.store.errors import ModelFileError, UnsupportedModelError

# Kept under its GGUF name: it has no HF counterpart (HF configs describe llama 3 scaling in rope_scaling).
ROPE_FREQS = "rope_freqs.weight"
# A reranker's classification head (llama.cpp's LLM_TENSOR_CLS_OUT), HF's `score` of a sequence classifier.
CLS_OUT = "cls.output.weight"
# Read into the config (Phi-3's LongRoPE), not kept as tensors.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# GGUF layer tensor stem (after "blk.{i}.") -> HF stem (after "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
EXPERT_STEMS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Layer tensors whose HF name has no `.weight` suffix.
BARE_TENSORS = {"attn_sinks": "self_attn.sinks"}
_NAME = re.compile(r"(?:blk\.(\d+)\.)?([a-z_]+)(?:\.(\d+))?\.(weight|bias)")  # fullmatched
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class Meta:
    """A GGUF header's metadata under one architecture prefix, and its tensor shapes (numpy order)."""

    def __init__(self, arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
        self.arch, self.metadata, self.shapes = arch, metadata, shapes

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if isinstance(value, list):  # per-layer values (llama.cpp allows them): one value for all, or an error
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"GGUF key {self.arch}.{key} differs between layers ({value[:8]}...)")
            value = value[0]
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {self.arch}.{key}, which a {self.arch} model needs")
        return value

    def has(self, name: str) -> bool:
        return name in self.shapes


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """One GGUF architecture: HF model_type, tensor names beyond `LAYER_TENSORS`, and its conventions."""

    model_type: str
    config: Callable[[Meta], dict[str, Any]] | None = None
    layer_tensors: dict[str, str] = field(default_factory=dict)
    permute_qk: bool = False
    norm_shift: float = 0.0  # the GGUF stores `norm_shift + w` for every norm weight w
    # GGUF expert stem -> HF per-expert name, `{e}` the expert (stacked `ffn_*_exps` or legacy `ffn_*.{e}`)
    experts: dict[str, str] = field(default_factory=dict)
    # HF keeps the experts stacked and fused as gpt-oss does (store/gguf_gpt_oss.py)
    fused_experts: bool = False
    # The HF sequence-classification class a file with a `cls.output` head is (None: llama.cpp reads no head)
    classifier: str | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one GGUF tensor goes: HF name (with `{e}` for stacked experts) and the fixes it needs."""

    hf_name: str
    unpermute_heads: int | None = None
    norm_shift: float = 0.0
    num_experts: int | None = None  # a stacked (experts, out, in) tensor split into one HF tensor each
    expert_part: str | None = None  # one GGUF part ("gate", "up", "down") of a fused HF expert tensor


# ---------------------------------------------------------------------------------------------
# Config keys of each architecture


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = meta.get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.get(f"rope.scaling.{key}") is not None:
                scaling[hf_key] = meta.get(f"rope.scaling.{key}")
        return scaling
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


# llama.cpp's keys for a model's recommended sampling -> HF generation_config's names
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def common_config(meta: Meta) -> dict[str, Any]:
    """The HF config keys every architecture shares."""
    hidden, heads = meta.require("embedding_length"), meta.require("attention.head_count")
    head_dim = meta.get("attention.key_length") or hidden // heads
    value_dim = meta.get("attention.value_length") or head_dim
    if value_dim != head_dim:
        raise UnsupportedModelError(f"GGUF key and value heads differ in size ({head_dim} vs {value_dim})")
    embed = meta.shapes.get("token_embd.weight")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": meta.require("block_count"),
        "intermediate_size": meta.get("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta.get("context_length", 4096),
        "vocab_size": meta.get("vocab_size") or (embed[0] if embed else None),
        "tie_word_embeddings": not meta.has("output.weight"),
        "attention_bias": meta.has("blk.0.attn_q.bias"),
    }
    if meta.get("rope.freq_base") is not None:
        config["rope_theta"] = meta.get("rope.freq_base")
    rotary = meta.get("rope.dimension_count") or head_dim
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    scaling = _rope_scaling(meta)
    if scaling:
        config["rope_scaling"] = scaling
    bos = meta.metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    # Generation ends at any end-of-generation token llama.cpp names: end of text, of turn, of message
    # (Gemma's <end_of_turn>, Llama 3's <|eot_id|>/<|eom_id|>), as HF lists them in generation_config.
    ends = [meta.metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(i for i in ends if i is not None))
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    generation = generation_config(meta.metadata)
    if generation:
        config["generation_config"] = generation
    return config


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The model's recommended sampling, llama.cpp's `general.sampling.*` keys, in HF generation_config's names
    (float32 values to the 7 digits they hold: 0.95, not 0.949999988)."""
    config: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = metadata.get(key)
        if isinstance(value, float):
            config[name] = float(f"{value:.7g}")
        elif isinstance(value, int) and not isinstance(value, bool):
            config[name] = value
    return config


def _check_softmax_gating(meta: Meta) -> None:
    """The routers here take a softmax over the experts; llama.cpp names it 1 in `expert_gating_func`."""
    gating = meta.get("expert_gating_func")
    if gating not in (None, 1):
        raise UnsupportedModelError(f"GGUF expert_gating_func {gating} is not supported (only softmax, 1)")


def _llama_config(meta: Meta) -> dict[str, Any]:
    experts = meta.get("expert_count") or 0
    if not experts:
        return {}
    _check_softmax_gating(meta)
    return {
        "model_type": "mixtral",
        "num_local_experts": experts,
        "num_experts_per_tok": meta.require("expert_used_count"),
    }


def _qwen3_moe_config(meta: Meta) -> dict[str, Any]:
    _check_softmax_gating(meta)
    num_layers = meta.require("block_count")
    return {
        "num_experts": meta.require("expert_count"),
        "num_experts_per_tok": meta.require("expert_used_count"),
        "moe_intermediate_size": meta.require("expert_feed_forward_length"),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),
        "mlp_only_layers": [i for i in range(num_layers) if not meta.has(f"blk.{i}.ffn_gate_inp.weight")],
    }


def _gemma_query_scalar(meta: Meta, big_layer_count: int) -> float:
    """llama.cpp's query scale: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B models."""
    if meta.require("block_count") == big_layer_count:
        return meta.require("embedding_length") // meta.require("attention.head_count")
    return meta.get("attention.key_length") or meta.require("embedding_length") // meta.require("attention.head_count")


def _gemma2_config(meta: Meta) -> dict[str, Any]:
    num_layers = meta.require("block_count")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_query_scalar(meta, 46),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "sliding_window": meta.require("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
    }


def _gemma3_config(meta: Meta) -> dict[str, Any]:
    num_layers = meta.require("block_count")
    window = meta.get("attention.sliding_window") or None
    # llama.cpp: every 6th layer global; a `sliding_window_pattern` key gives the period, or a flag per layer.
    pattern = meta.metadata.get(f"{meta.arch}.attention.sliding_window_pattern") or 6
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelFileError(f"GGUF sliding_window_pattern has {len(pattern)} flags for {num_layers} layers")
        is_sliding = [bool(window) and bool(flag) for flag in pattern]
    else:
        is_sliding = [bool(window) and (i + 1) % pattern != 0 for i in range(num_layers)]
    return {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_query_scalar(meta, 62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.get("final_logit_softcapping") or None,
        "sliding_window": window,
        "rope_local_base_freq": meta.get("rope.freq_base_swa", 10000.0),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in is_sliding],
    }


def _phi3_config(meta: Meta) -> dict[str, Any]:
    config: dict[str, Any] = {"sliding_window": meta.get("attention.sliding_window") or None}
    if meta.has(ROPE_FACTORS[0]):
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": meta.require("rope.scaling.original_context_length"),
            "attention_factor": meta.get("rope.scaling.attn_factor", 1.0),
            # filled in from the tensors by the reader (`long_factor`, `short_factor`)
        }
    return config


def _gpt_oss_config(meta: Meta) -> dict[str, Any]:
    num_layers = meta.require("block_count")
    scaling = _rope_scaling(meta)
    return {
        "num_local_experts": meta.require("expert_count"),
        "num_experts_per_tok": meta.require("expert_used_count"),
        "intermediate_size": meta.require("expert_feed_forward_length"),
        "sliding_window": meta.require("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "rope_scaling": {**scaling, "truncate": False} if scaling else {"rope_type": "default"},
    }


def _qwen2vl_config(meta: Meta) -> dict[str, Any]:
    """Qwen2-VL's and Qwen2.5-VL's language model: Qwen2 with M-RoPE's sections (llama.cpp pads them to
    four), which a text-only run does not need (a text token's three positions are one)."""
    sections = meta.metadata.get(f"{meta.arch}.rope.dimension_sections") or [16, 24, 24]
    rope = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base", 1_000_000.0)}
    return {"model_type": "qwen2", "rope_parameters": {**rope, "mrope_section": [int(s) for s in sections[:3]]}}


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "llama",
        _llama_config,
        permute_qk=True,
        layer_tensors={"ffn_gate_inp": "block_sparse_moe.gate"},
        experts={
            "ffn_gate": "block_sparse_moe.experts.{e}.w1",
            "ffn_down": "block_sparse_moe.experts.{e}.w2",
            "ffn_up": "block_sparse_moe.experts.{e}.w3",
        },
    ),
    "qwen2": ArchSpec("qwen2"),
    "qwen2vl": ArchSpec("qwen2", _qwen2vl_config),
    "qwen3": ArchSpec("qwen3", classifier="Qwen3ForSequenceClassification"),
    "qwen3moe": ArchSpec(
        "qwen3_moe",
        _qwen3_moe_config,
        experts={f"ffn_{p}": f"mlp.experts.{{e}}.{p}_proj" for p in ("gate", "up", "down")},
    ),
    "gemma2": ArchSpec("gemma2", _gemma2_config, layer_tensors=_GEMMA_NORMS, norm_shift=1.0),
    "gemma3": ArchSpec("gemma3_text", _gemma3_config, layer_tensors=_GEMMA_NORMS, norm_shift=1.0),
    "phi3": ArchSpec("phi3", _phi3_config),
    "smollm3": ArchSpec("smollm3", lambda _: {"no_rope_layer_interval": 4}, permute_qk=True),
    "gpt-oss": ArchSpec(
        "gpt_oss",
        _gpt_oss_config,
        layer_tensors={"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"},
        fused_experts=True,
    ),
}


def arch_spec(metadata: dict[str, Any]) -> tuple[str, ArchSpec]:
    arch = metadata.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    return arch, ARCHS[arch]


# ---------------------------------------------------------------------------------------------
# Tensor names


def placement(name: str, spec: ArchSpec, config: dict[str, Any], meta: Meta) -> Placement | None:
    """Where GGUF tensor `name` goes in the HF checkpoint; None for tensors read into the config."""
    if name == ROPE_FREQS:  # llama 3's rope scaling, as per-frequency divisors; the loader hands it to the RoPE
        return Placement(name)
    if name in ROPE_FACTORS:
        return None
    if name == CLS_OUT and spec.classifier is not None:
        return Placement("score.weight")
    match = _NAME.fullmatch(name)
    if not match:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no known place in a {config['model_type']} model")
    layer, stem, expert, kind = match.groups()
    if layer is None:
        if stem not in GLOBAL_TENSORS:
            raise UnsupportedModelError(f"GGUF tensor {name!r} has no known place in a {config['model_type']} model")
        shift = spec.norm_shift if stem == "output_norm" and kind == "weight" else 0.0
        return Placement(f"{GLOBAL_TENSORS[stem]}.{kind}", norm_shift=shift)
    if stem in BARE_TENSORS and kind == "weight":
        return Placement(f"model.layers.{layer}.{BARE_TENSORS[stem]}")
    if spec.fused_experts and stem in EXPERT_STEMS:
        part = stem.removeprefix("ffn_").removesuffix("_exps")
        fused = "gate_up_proj" if part in ("gate", "up") else "down_proj"
        suffix = "" if kind == "weight" else "_bias"
        return Placement(f"model.layers.{layer}.mlp.experts.{fused}{suffix}", expert_part=part)
    target = _layer_target(stem, expert, spec, meta, layer)
    if target is None:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no known place in a {config['model_type']} model")
    hf_name = f"model.layers.{layer}.{target}.{kind}"
    if stem in EXPERT_STEMS:
        return Placement(hf_name, num_experts=meta.shapes[name][0])
    heads = None
    if spec.permute_qk and stem in ("attn_q", "attn_k"):  # the converter permutes biases too
        heads = config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
    shift = spec.norm_shift if stem.endswith("norm") and kind == "weight" else 0.0
    return Placement(hf_name, heads, shift)


def _layer_target(stem: str, expert: str | None, spec: ArchSpec, meta: Meta, layer: str) -> str | None:
    """The HF stem of a layer tensor; `{e}` stands for the expert of stacked or legacy per-expert tensors."""
    if stem in EXPERT_STEMS or expert is not None:
        template = spec.experts.get(stem.removesuffix("_exps"))
        return template if expert is None or template is None else template.replace("{e}", expert)
    if spec.model_type == "phi3" and stem == "ffn_up" and not meta.has(f"blk.{layer}.ffn_gate.weight"):
        return "mlp.gate_up_proj"  # Phi-3 keeps gate and up fused in one matrix, gate rows first
    return spec.layer_tensors.get(stem, LAYER_TENSORS.get(stem))


# ---------------------------------------------------------------------------------------------
