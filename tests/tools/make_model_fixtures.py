"""Writes tiny random HF models and transformers' logits for them to tests/fixtures/models/.

Dev tool (needs torch and transformers, which neither the package nor the tests import):

    python tests/tools/make_model_fixtures.py [name ...]

Each fixture folder holds `config.json`, `model.safetensors` (float32), `generation_config.json`
when transformers writes one, and `reference.npz` with:
  input_ids (T,) int32 and logits (T, vocab): all-position logits of one forward pass;
  input_ids_b / logits_b: a second, shorter sequence;
  for `decode_from` fixtures, decode_logits (T, vocab): transformers' logits when the first
  `decode_from` tokens are one prefill and each later token is its own cached step.
Some fixtures also get `config_legacy.json`: the same model described with the older config keys
(`rope_theta`, `rope_scaling`, ...), checked here to give transformers the same logits.
Variants reuse a fixture's weights under another config (`config_<variant>.json`, e.g. a RoPE
scaling or a sliding window), with transformers' logits for input_ids as `logits_<variant>`.
Weights are redrawn with unit-scale statistics so that logits, soft-caps and routing are not
all near zero, as they would be with the usual 0.02 initialisation.
`gpt_oss_mxfp4` stores its experts as released gpt-oss checkpoints do: random MXFP4
`*_blocks`/`*_scales` and a `quantization_config`; transformers dequantizes them on reload
(checked here to give float32 values equal to a longhand decode) to compute the reference.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
SEED = 1234
NUM_TOKENS, NUM_TOKENS_B = 16, 9

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (config class, overrides of COMMON, extra fixture options)
FIXTURES = {
    "llama": (
        "LlamaConfig",
        {},
        {"variants": {"linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}}},
    ),
    "llama_rope3_mqa": (
        "LlamaConfig",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        {"legacy": True},
    ),
    "mistral": ("MistralConfig", dict(sliding_window=5), {}),
    "qwen2": (
        "Qwen2Config",
        dict(tie_word_embeddings=True),
        # Only layers from max_window_layers on slide.
        {
            "variants": {
                "window": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1, "layer_types": None}
            }
        },
    ),
    "qwen3": (
        "Qwen3Config",
        dict(head_dim=24),
        {
            "variants": {
                "yarn": {
                    "rope_parameters": dict(
                        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8
                    )
                },
                "yarn_mscale": {
                    "rope_parameters": dict(
                        rope_type="yarn",
                        rope_theta=10000.0,
                        factor=4.0,
                        original_max_position_embeddings=8,
                        mscale=1.0,
                        mscale_all_dim=0.5,
                        beta_fast=16,
                    )
                },
            }
        },
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
        {},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            sliding_window=6,
            query_pre_attn_scalar=16,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
        ),
        {"legacy": True},
    ),
    "phi3": (
        "Phi3Config",
        dict(
            max_position_embeddings=64,
            original_max_position_embeddings=12,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.2, 1.5, 2.0],
                long_factor=[1.5, 3.0, 6.0, 12.0],
            ),
        ),
        # Prefills stay within the trained 12 positions; decoding runs past them to the long factors.
        {"num_tokens": 12, "decode_from": 8, "decode_tokens": 18},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1]),
        {"variants": {"window": {"use_sliding_window": True, "sliding_window": 5}}},
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        {"variants": {"window": {"sliding_window": 5}}},
    ),
    # Layer 3 has no RoPE (every 4th layer, as released and as llama.cpp assumes); the window
    # variant makes that NoPE layer slide.
    "smollm3": (
        "SmolLM3Config",
        dict(num_hidden_layers=4),
        {"variants": {"window": {"use_sliding_window": True, "sliding_window": 5, "layer_types": None}}},
    ),
    # Sinks, a sliding layer and a full one, YaRN as released (no truncation: its ramp then spans
    # rotary pairs 2 to 4 of 8), a SwiGLU clamp low enough to bite with these weights.
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=5,
            swiglu_limit=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
        ),
        # The clamp llama.cpp applies (GGUF files do not carry it).
        {"variants": {"limit7": {"swiglu_limit": 7.0}}},
    ),
}
# The gpt_oss fixture with its experts stored as released checkpoints store them: MXFP4 blocks and scales.
FIXTURES["gpt_oss_mxfp4"] = (*FIXTURES["gpt_oss"][:2], {"mxfp4": True, **FIXTURES["gpt_oss"][2]})


def _legacy_config(config: dict) -> dict:
    """The config as older checkpoints spell it: rope_theta + rope_scaling, Gemma 3's local base and pattern."""
    legacy = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    rope = config["rope_parameters"]
    if "full_attention" in rope:  # Gemma 3: per layer type
        legacy["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
        kinds = config["layer_types"]
        pattern = kinds.index("full_attention") + 1
        assert kinds == ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(kinds))]
        legacy["sliding_window_pattern"] = pattern
    legacy["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    legacy["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
    return legacy


def _redraw(model: torch.nn.Module, zero_centered_norms: bool) -> None:
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((0.0 if zero_centered_norms else 1.0) + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.25 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _reload(folder: Path, config_path: Path | None = None):
    """The saved model as transformers reads it (eager attention, float32), under another config if given."""
    kwargs = {"attn_implementation": "eager", "dtype": torch.float32}
    if config_path is not None:
        model_type = json.loads(config_path.read_text())["model_type"]
        kwargs["config"] = CONFIG_MAPPING[model_type].from_json_file(str(config_path))
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def _decode_logits(model, ids: torch.Tensor, decode_from: int) -> torch.Tensor:
    """Prefill of `decode_from` tokens, then one cached step per token, as transformers generates."""
    with torch.no_grad():
        out = model(ids[None, :decode_from], use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for i in range(decode_from, len(ids)):
            out = model(ids[None, i : i + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows).float()


def make(name: str) -> None:
    class_name, overrides, options = FIXTURES[name]
    torch.manual_seed(SEED)
    config = getattr(transformers, class_name)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _redraw(model, zero_centered_norms=class_name.startswith("Gemma"))
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    if options.get("mxfp4"):
        _save_mxfp4(model, folder)
    else:
        model.save_pretrained(folder)
    # Reload: the reference is what transformers computes from the files as written.
    model = _reload(folder)
    if options.get("mxfp4"):
        _check_mxfp4_reload(model, folder)
    gen = torch.Generator().manual_seed(SEED + 1)
    num_tokens = options.get("num_tokens", NUM_TOKENS)
    ids = torch.randint(3, COMMON["vocab_size"], (num_tokens,), generator=gen)
    ids_b = torch.randint(3, COMMON["vocab_size"], (NUM_TOKENS_B,), generator=gen)
    ref = {
        "input_ids": ids.int(),
        "logits": _logits(model, ids),
        "input_ids_b": ids_b.int(),
        "logits_b": _logits(model, ids_b),
    }
    if "decode_from" in options:
        long_ids = torch.randint(3, COMMON["vocab_size"], (options["decode_tokens"],), generator=gen)
        ref["decode_ids"] = long_ids.int()
        ref["decode_logits"] = _decode_logits(model, long_ids, options["decode_from"])
        ref["decode_from"] = torch.tensor(options["decode_from"], dtype=torch.int32)
    if options.get("legacy"):
        _write_legacy(folder, ids, ref["logits"])
    for variant, change in options.get("variants", {}).items():
        ref[f"logits_{variant}"] = _variant_logits(folder, model, variant, change, ids)
    np.savez(folder / "reference.npz", **{k: v.numpy() for k, v in ref.items()})
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, logits |max| {ref['logits'].abs().max():.2f}")


FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _random_mxfp4(shape: tuple[int, ...], in_features: int, gen: torch.Generator):
    """Random MXFP4 (blocks, scales) of an (experts, out, in) weight as HF checkpoints store it:
    blocks (experts, out, in / 32, 16) uint8, two E2M1 codes a byte (low nibble first); scales
    (experts, out, in / 32) uint8 exponents biased by 127, drawn so values are about 1/sqrt(in)."""
    groups = in_features // 32
    blocks = torch.randint(0, 256, (*shape, groups, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    low = 127 - round(math.log2(math.sqrt(in_features))) - 2
    scales = torch.randint(low, low + 3, (*shape, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(experts, out, in) float32 values of MXFP4 blocks and scales, written out longhand."""
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # (..., groups, 16, 2)
    values = lut[codes].reshape(*blocks.shape[:-1], 32) * torch.exp2(scales.float() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def _save_mxfp4(model, folder: Path) -> None:
    """Saves `model` with random MXFP4 experts (its float experts set to their values, so the two agree),
    as released gpt-oss checkpoints are laid out: `*_blocks`/`*_scales` and a `quantization_config`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED + 2)
    packed = {}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # (experts, in, out)
            num_experts, in_features, out_features = param.shape
            blocks, scales = _random_mxfp4((num_experts, out_features), in_features, gen)
            with torch.no_grad():
                param.copy_(_dequantize_mxfp4(blocks, scales).transpose(1, 2))
            prefix = f"model.layers.{i}.mlp.experts.{proj}"
            packed.update({f"{prefix}_blocks": blocks, f"{prefix}_scales": scales})
    model.save_pretrained(folder)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("_proj")}
    save_file({**tensors, **packed}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _check_mxfp4_reload(model, folder: Path) -> None:
    """transformers must have read the MXFP4 experts as float32 equal to their longhand values."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            prefix = f"model.layers.{i}.mlp.experts.{proj}"
            expected = _dequantize_mxfp4(tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"]).transpose(1, 2)
            loaded = getattr(layer.mlp.experts, proj)
            if loaded.dtype != torch.float32 or not torch.equal(loaded, expected):
                raise SystemExit(f"{folder.name}: transformers read {prefix} differently ({loaded.dtype})")


def _variant_logits(folder: Path, model, variant: str, change: dict, ids: torch.Tensor) -> torch.Tensor:
    """Writes config_<variant>.json and returns transformers' logits for it, on the same weights."""
    config = {**json.loads((folder / "config.json").read_text()), **change}
    config = {k: v for k, v in config.items() if v is not None or k not in change}
    path = folder / f"config_{variant}.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    logits = _logits(_reload(folder, path), ids)
    if (logits - _logits(model, ids)).abs().max() < 1e-2:
        raise SystemExit(f"{folder.name}: variant {variant} does not change the logits; it would test nothing")
    return logits


def _write_legacy(folder: Path, ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Writes config_legacy.json and checks that transformers reads it as the same model."""
    config = json.loads((folder / "config.json").read_text())
    legacy = _legacy_config(config)
    path = folder / "config_legacy.json"
    path.write_text(json.dumps(legacy, indent=2) + "\n")
    diff = (_logits(_reload(folder, path), ids) - logits).abs().max().item()
    if diff > 1e-6:
        raise SystemExit(f"{folder.name}: config_legacy.json gives transformers different logits ({diff})")


if __name__ == "__main__":
    for fixture in sys.argv[1:] or FIXTURES:
        make(fixture)
