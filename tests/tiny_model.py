"""The tiny models the engine, API, chat and CLI tests run, built from the committed fixtures.

- `loaded_fixture(name)`: a fixture model as it is (tests/fixtures/models/<name>, 256-id
  vocabulary) with the fixture BPE tokenizer and no end-of-sequence ids, for engines fed raw
  token ids: every request runs to max_tokens.
- `widened_llama(tokenizer)`: the tiny llama widened to the BPE tokenizer's vocabulary. Chat
  prompts through that tokenizer (ChatML template) use ids up to 701, so the extra embedding and
  output rows are filled with seeded random values.
- `loaded_widened_llama(name)`: that model loaded, ending at the tokenizer's end-of-sequence ids.
- `write_model_folder(folder)`: that model written as an HF folder `load_model` reads.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from baselm.backend import select_backend
from baselm.loader import LoadedModel
from baselm.models import build_model
from baselm.store import hf
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER, LLAMA_FIXTURE, MODEL_FIXTURES


@functools.cache
def loaded_fixture(name: str = "llama") -> LoadedModel:
    """The fixture model `name` (512 positions) with the BPE tokenizer and no end-of-sequence ids."""
    folder = MODEL_FIXTURES / name
    config = hf.read_config(folder)
    config["max_position_embeddings"] = 512
    model = build_model(config, hf.read_weights(folder))
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    return LoadedModel(name, folder, model, tokenizer, config, (), select_backend("cpu"))


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


@functools.cache
def loaded_widened_llama(name: str) -> LoadedModel:
    """The widened tiny llama, served as `name`, with the BPE tokenizer (ChatML template). End-of-sequence
    ids are the tokenizer's (<|im_end|>, <|endoftext|>), so answers can end."""
    tokenizer = Tokenizer.from_folder(BPE_TOKENIZER)
    config, weights = widened_llama(tokenizer)
    model = build_model(config, weights)
    return LoadedModel(name, LLAMA_FIXTURE, model, tokenizer, config, tokenizer.eos_token_ids, select_backend("cpu"))


def write_model_folder(folder: Path, *, eos: bool = True, max_position_embeddings: int = 2048) -> Path:
    """The widened tiny llama as an HF folder `load_model` reads. With `eos=False` the model has no
    end-of-sequence token, so every answer runs to max_tokens."""
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


# The fixture ChatML template with a reasoning model's generation prompt (as DeepSeek-R1 and
# Qwen3 write it): the answer starts inside <think>, unless enable_thinking is false.
_THINKING_PROMPT = (
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
)


def thinking_template() -> str:
    """The fixture ChatML template as a reasoning model's: its generation prompt opens `<think>`."""
    template = (BPE_TOKENIZER / "chat_template.jinja").read_text()
    generation = "{{- '<|im_start|>assistant\\n' }}"
    assert template.count(generation) == 1, "the fixture template changed"
    return template.replace(generation, _THINKING_PROMPT)


@functools.cache
def loaded_thinking_llama(name: str) -> LoadedModel:
    """The widened tiny llama whose chat template makes it a reasoning model (`<think>` is a
    plain added token of the fixture tokenizer, id 700; `</think>` is 701)."""
    base = Tokenizer.from_folder(BPE_TOKENIZER)
    tokenizer_json, config = base.to_hf_files()
    tokenizer = Tokenizer.from_hf_files(tokenizer_json, config, thinking_template(), base.eos_token_ids)
    model_config, weights = widened_llama(tokenizer)
    model = build_model(model_config, weights)
    return LoadedModel(
        name, LLAMA_FIXTURE, model, tokenizer, model_config, tokenizer.eos_token_ids, select_backend("cpu")
    )
