"""LoRA adapters for the tiny llama as files, for the adapter tests: the committed PEFT fixture
(tests/fixtures/adapters, made with transformers + PEFT), that fixture as llama.cpp's converter writes
it (`gguf_lora`), and seeded random PEFT adapters on other projections (`peft_adapter`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

from tests.paths import BPE_TOKENIZER, FIXTURES, LLAMA_FIXTURE
from tests.tiny_gguf import llama_cpp_permute

ADAPTERS = FIXTURES / "adapters"
PEFT = ADAPTERS / "peft-llama"  # q_proj, v_proj and down_proj of both layers, r 4, alpha 8
MLX = ADAPTERS / "mlx-llama"  # the same adapter in mlx-lm's layout
_SUBLAYER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def llama_folder(folder: Path) -> Path:
    """The tiny llama fixture with the fixture tokenizer beside it, as a folder `load_model` reads."""
    shutil.copytree(LLAMA_FIXTURE, folder)
    for file in BPE_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def gguf_lora(path: Path) -> Path:
    """The PEFT fixture as llama.cpp's convert_lora_to_gguf.py writes it: GGUF names, `lora_a` (r, in),
    `lora_b` (out, r) with q/k rows permuted as the base model's (llama), alpha in the metadata."""
    config = json.loads((PEFT / "adapter_config.json").read_text())
    model_config = json.loads((LLAMA_FIXTURE / "config.json").read_text())
    tensors = {k: np.array(v) for k, v in mx.load(str(PEFT / "adapter_model.safetensors")).items()}
    stems = {"self_attn.q_proj": "attn_q", "self_attn.v_proj": "attn_v", "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name in sorted(tensors):
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0].removeprefix("base_model.model.model.layers.")
        layer, hf_stem = module.split(".", 1)
        up = tensors[name.replace(".lora_A.", ".lora_B.")]
        if hf_stem == "self_attn.q_proj":
            up = llama_cpp_permute(up, model_config["num_attention_heads"])
        base = f"blk.{layer}.{stems[hf_stem]}.weight"
        writer.add_tensor(f"{base}.lora_a", np.ascontiguousarray(tensors[name]))
        writer.add_tensor(f"{base}.lora_b", np.ascontiguousarray(up))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def peft_adapter(
    folder: Path, targets: tuple[str, ...], seed: int, config: dict | None = None, rank: int = 2, alpha: float = 4.0
) -> Path:
    """A PEFT adapter folder on `targets` (projection names) of every layer of the llama `config` (the
    tiny llama's by default), its A and B drawn from a seeded normal distribution (0.2 sd): an adapter
    with no training behind it, whose reference is the same adapter merged as the model loads."""
    config = config or json.loads((LLAMA_FIXTURE / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {  # (out, in)
        "q_proj": (q_out, hidden),
        "k_proj": (kv_out, hidden),
        "v_proj": (kv_out, hidden),
        "o_proj": (hidden, q_out),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            out, inputs = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{_SUBLAYER.get(target, 'mlp')}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = mx.array(rng.normal(0, 0.2, (rank, inputs)).astype(np.float32))
            tensors[f"{prefix}.lora_B.weight"] = mx.array(rng.normal(0, 0.2, (out, rank)).astype(np.float32))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), tensors)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder
