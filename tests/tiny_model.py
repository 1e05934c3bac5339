"""The tiny fixture llama widened to the fixture BPE tokenizer's vocabulary, for chat-shaped tests.

The fixture model (tests/fixtures/models/llama) has 256 embedding rows; chat prompts through
the fixture tokenizer (tests/fixtures/tokenizers/bpe, ChatML template) use ids up to 701, so
the extra embedding and output rows are filled with seeded random values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from baselm.store import hf
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER, LLAMA_FIXTURE


def widened_llama(tokenizer: Tokenizer, max_position_embeddings: int = 2048) -> tuple[dict, dict[str, mx.array]]:
    """Config and weights of the tiny llama with one embedding/output row per tokenizer id."""
    config = hf.read_config(LLAMA_FIXTURE)
    config["max_position_embeddings"] = max_position_embeddings
    config["vocab_size"] = tokenizer.vocab_size
    weights = hf.read_weights(LLAMA_FIXTURE)
    rng = np.random.default_rng(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]  # (256, hidden)
        extra = rng.normal(0.0, 0.02, (tokenizer.vocab_size - rows.shape[0], rows.shape[1])).astype(np.float32)
        weights[name] = mx.concatenate([rows, mx.array(extra)])  # (vocab, hidden)
    return config, weights


def write_model_folder(folder: Path, *, eos: bool = True, max_position_embeddings: int = 2048) -> Path:
    """An HF folder `load_model` reads. With `eos=False` the model has no end-of-sequence token,
    so every answer runs to max_tokens."""
    config, weights = widened_llama(Tokenizer.from_folder(BPE_TOKENIZER), max_position_embeddings)
    folder.mkdir(parents=True, exist_ok=True)
    names = ["tokenizer.json", "chat_template.jinja"]
    tokenizer_config = json.loads((BPE_TOKENIZER / "tokenizer_config.json").read_text())
    if eos:
        names.append("generation_config.json")
    else:
        config["eos_token_id"] = None
        tokenizer_config["eos_token"] = None
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    for name in names:
        shutil.copy(BPE_TOKENIZER / name, folder / name)
    return folder
