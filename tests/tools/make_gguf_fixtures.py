"""Writes transformers' logits for the model fixtures loaded from GGUF files, to tests/fixtures/models/.

Dev tool (needs torch and transformers, which neither the package nor the tests import):

    PYTHONPATH=. python tests/tools/make_gguf_fixtures.py [name ...]

Each fixture's GGUF is written exactly as the tests write it (`tests.tiny_gguf.fixture_gguf`: the
converter's names, q/k permutation, Gemma's `1 + w` norms, stacked experts, F32) and loaded with
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, whose GGUF reader undoes llama.cpp's
conventions on its own. `gguf_reference.npz` holds input_ids (the fixture's), logits (T, vocab) and
`overrides` (JSON): config keys passed to transformers because its GGUF reader does not read them
(soft-caps, query scale, RoPE scaling, Qwen3's head size, Qwen3-MoE's expert size), set to what
llama.cpp derives from the same file.

Mixtral and `qwen3_moe` are absent: transformers reads a llama GGUF with experts as a dense llama, and
the `qwen3_moe` fixture has a dense layer (`mlp_only_layers`), which its GGUF reader (like llama.cpp's)
does not place; `qwen3_moe_sparse` (made here, experts in every layer) stands in for it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from tests.paths import MODEL_FIXTURES
from tests.tiny_gguf import fixture_gguf

NAMES = ["llama", "llama_rope3_mqa", "mistral", "qwen2", "qwen3", "qwen3_moe_sparse", "gemma2", "gemma3", "phi3"]
# A Qwen3-MoE with experts in every layer and renormalized top-k weights, as llama.cpp's qwen3moe
# reads them: the HF fixture transformers (and llama.cpp) can read from a GGUF. Made here with
# make_model_fixtures.py's recipe; its reference.npz holds transformers' HF-folder logits.
EXTRA_FIXTURES = {
    "qwen3_moe_sparse": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        {},
    )
}


def overrides(name: str, config: dict) -> dict:
    """Config keys transformers' GGUF reader leaves at their defaults, as llama.cpp reads the file."""
    head_dim = config["head_dim"]
    if name == "gemma2":
        return {
            "query_pre_attn_scalar": head_dim,
            "attn_logit_softcapping": config["attn_logit_softcapping"],
            "final_logit_softcapping": config["final_logit_softcapping"],
        }
    if name == "gemma3":
        full = config["rope_parameters"]["full_attention"]
        return {
            "query_pre_attn_scalar": head_dim,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": full["factor"], "rope_theta": full["rope_theta"]},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }
    if name == "phi3":  # (and Phi3Config's default pad id 32000 lies outside the tiny vocabulary)
        return {
            "rope_parameters": config["rope_parameters"],
            "original_max_position_embeddings": config["original_max_position_embeddings"],
            "pad_token_id": config["pad_token_id"],
        }
    if name == "llama_rope3_mqa":
        return {"rope_parameters": config["rope_parameters"]}
    if name == "qwen3":  # its reader maps no key to head_dim for qwen3 (attention.key_length is in the file)
        return {"head_dim": head_dim}
    if name == "qwen3_moe_sparse":  # nor to moe_intermediate_size (expert_feed_forward_length is in the file)
        return {"moe_intermediate_size": config["moe_intermediate_size"]}
    return {}


def make(name: str) -> None:
    if name in EXTRA_FIXTURES and not (MODEL_FIXTURES / name / "reference.npz").exists():
        import make_model_fixtures

        make_model_fixtures.FIXTURES.update(EXTRA_FIXTURES)
        make_model_fixtures.make(name)
    folder = MODEL_FIXTURES / name
    ids = np.load(folder / "reference.npz")["input_ids"]
    with tempfile.TemporaryDirectory() as tmp:
        path, config = fixture_gguf(Path(tmp) / f"{name}.gguf", folder)
        extra = overrides(name, config)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=path.name, dtype=torch.float32, **extra
        )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    np.savez_compressed(
        folder / "gguf_reference.npz",
        input_ids=ids,
        logits=logits.astype(np.float32),
        overrides=np.array(json.dumps(extra, sort_keys=True)),
    )
    hf = np.load(folder / "reference.npz")["logits"]
    print(f"{name}: {type(model).__name__}, |transformers(gguf) - transformers(hf)| = {np.abs(logits - hf).max():.3g}")


if __name__ == "__main__":
    for fixture in sys.argv[1:] or NAMES:
        make(fixture)
