"""Writes tiny random classification-head rerankers and transformers' scores for them: tests/fixtures/rerankers/.

Dev tool (needs torch and transformers, the `fixtures` extra, which neither the package nor the tests import):

    .venv/bin/python tests/tools/make_rerank_fixtures.py

Each folder is an HF `*ForSequenceClassification` checkpoint of an architecture base runs (the decoder
and a `score` head of one label, float32, weights redrawn at unit scale as the model fixtures are) with
one of the committed tokenizers, and `reference.json`: the query and documents, transformers' ids for
each (query, document) pair (`tokenizer(query, document)`, as sentence-transformers' CrossEncoder
encodes a pair), the head's logit (read by transformers at the last token that is not padding) and
its sigmoid, the relevance CrossEncoder gives a one-label head.

- `qwen3`: Qwen3ForSequenceClassification, the byte-level BPE of tests/fixtures/tokenizers/bpe (no
  special tokens around a pair), padding `<|endoftext|>`; one document ends with that token, which
  transformers skips when it reads the head.
- `llama`: LlamaForSequenceClassification, the SentencePiece tokenizer of tests/fixtures/tokenizers/spm
  (`<s>` before each text of a pair), no padding token.
- `gemma2`: Gemma2ForSequenceClassification with the same tokenizer; Gemma 2 soft-caps its LM logits,
  which a classification head is not.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))

from make_model_fixtures import _redraw  # noqa: E402
from make_rerank_reference import DOCUMENTS as GGUF_DOCUMENTS  # noqa: E402
from make_rerank_reference import QUERY  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "rerankers"
TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"
SEED = 4321
DOCUMENTS = [*GGUF_DOCUMENTS, "France's capital? Paris.<|endoftext|>"]  # the GGUF rerankers' and one ending in padding
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    num_labels=1,
)
# name -> (config class, model class, tokenizer folder, padding id, overrides of COMMON)
FIXTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", "bpe", 0, {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", "spm", None, {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForSequenceClassification",
        "spm",
        None,
        {"final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8, "sliding_window": 16},
    ),
}


def make(name: str) -> None:
    config_class, model_class, tokenizer_name, pad_token_id, overrides = FIXTURES[name]
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZERS / tokenizer_name / file, folder / file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(SEED)
    config = getattr(transformers, config_class)(
        **COMMON, **overrides, vocab_size=len(tokenizer), pad_token_id=pad_token_id
    )
    model = getattr(transformers, model_class)(config).to(torch.float32)
    _redraw(model, zero_centered_norms=name.startswith("gemma"))
    model.save_pretrained(folder)
    # The reference is what transformers computes from the files as written.
    model = getattr(transformers, model_class).from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(QUERY, document)["input_ids"] for document in DOCUMENTS]
    with torch.no_grad():
        logits = [model(torch.tensor([row])).logits[0].tolist() for row in ids]
    reference = {
        "query": QUERY,
        "documents": DOCUMENTS,
        "pair_ids": ids,
        "logits": logits,
        "scores": [torch.sigmoid(torch.tensor(row[0], dtype=torch.float64)).item() for row in logits],
    }
    (folder / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, logits {[round(row[0], 3) for row in logits]}")


if __name__ == "__main__":
    for fixture in sys.argv[1:] or FIXTURES:
        make(fixture)
