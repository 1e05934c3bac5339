"""Where the committed test fixtures live (tests/fixtures; see its READMEs for how each was made)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL_FIXTURES = FIXTURES / "models"  # tiny random HF models, one folder per architecture
TOKENIZER_FIXTURES = FIXTURES / "tokenizers"  # HF folders and GGUF files, with transformers' outputs
GGUF_TOKENIZER_FIXTURES = FIXTURES / "gguf_tokenizers"  # Gemma's and pre-tokenizer names' ids from transformers
TEXT_FIXTURES = FIXTURES / "text"
LLAMA_FIXTURE = MODEL_FIXTURES / "llama"  # the tiny llama (256-id vocabulary) most tests run
BPE_TOKENIZER = TOKENIZER_FIXTURES / "bpe"  # an HF tokenizer folder with a ChatML template
