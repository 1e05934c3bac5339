"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization.

- `tokenizer.py`: `Tokenizer`, built from HF files or GGUF metadata; encode, decode, chat prompts.
- `gguf_vocab.py`: the `tokenizers` backend a GGUF file's tokenizer metadata describes.
- `gguf_splits.py`: how a byte-level GGUF vocabulary cuts text into words (`tokenizer.ggml.pre`).
- `chat_template.py`: HF chat templates rendered in jinja2's immutable sandbox.
- `detokenizer.py`: `StreamingDetokenizer`, generated text one token at a time.
- `errors.py`: `TokenizerError`, `ChatTemplateError`.
"""
