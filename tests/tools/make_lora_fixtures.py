"""Writes tests/fixtures/adapters/: one LoRA adapter on the tiny llama fixture in PEFT's layout and
the same adapter in mlx-lm's, and transformers + PEFT's logits with it applied.

    /path/to/python-with-fixtures-extra-and-peft -m tests.tools.make_lora_fixtures

PEFT starts LoRA's B at zero; here both factors are random (seeded), so the adapter changes the
logits. The mlx-lm copy holds `lora_a = A^T`, `lora_b = B^T * (alpha / r) / scale`, which mlx-lm
applies as `scale * (x a) b`: the same delta.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = ROOT / "models" / "llama"
OUT = ROOT / "adapters"
PROMPT = [1, 5, 9, 42, 7, 3, 100, 200]
RANK, ALPHA, MLX_SCALE = 4, 8.0, 2.0
TARGETS = ["q_proj", "v_proj", "down_proj"]


def main() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(LLAMA, torch_dtype=torch.float32).eval()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)
        logits = peft_model(torch.tensor([PROMPT])).logits[0].numpy()
    peft_dir = OUT / "peft-llama"
    peft_model.save_pretrained(peft_dir)
    (peft_dir / "README.md").unlink(missing_ok=True)
    mlx_dir = OUT / "mlx-llama"
    mlx_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in peft_model.named_parameters():
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0].removeprefix("base_model.model.")
            up = dict(peft_model.named_parameters())[name.replace(".lora_A.", ".lora_B.")]
            tensors[f"{module}.lora_a"] = param.detach().numpy().T.copy()
            tensors[f"{module}.lora_b"] = (up.detach().numpy().T * (ALPHA / RANK) / MLX_SCALE).copy()
    save_file(tensors, str(mlx_dir / "adapters.safetensors"))
    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
    lora = {"rank": RANK, "scale": MLX_SCALE, "dropout": 0.0, "keys": keys}
    mlx_config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}
    (mlx_dir / "adapter_config.json").write_text(json.dumps(mlx_config))
    np.savez(OUT / "peft-llama-logits.npz", prompt=np.array(PROMPT), logits=logits)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
