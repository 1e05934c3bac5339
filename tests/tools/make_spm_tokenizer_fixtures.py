"""Writes transformers' ids for Llama 2 / Mistral SentencePiece GGUFs: tests/fixtures/gguf_tokenizers/llama-spm.json.

Dev tool: needs `transformers` (the `fixtures` extra), which the package and the tests never import:

    python tests/tools/make_spm_tokenizer_fixtures.py [--llama-cpp-models DIR]

The file is llama.cpp's `ggml-vocab-llama-spm.gguf` (Llama 2's 32,000 pieces with scores and no
merges, `tokenizer.ggml.model` llama, architecture llama; llama-cpp-python's sdist carries it, as
the tests fetch it: tests/llama_cpp_files.py), read by `AutoTokenizer.from_pretrained(folder,
gguf_file=...)`. The corpus is the Gemma fixtures' (make_gemma_tokenizer_fixtures.py: the edge-case
corpus, every text of llama.cpp's tokenizer test vectors, whitespace runs, code, many scripts,
emoji) and the texts below: Llama's special tokens and [INST] prompts written in text, and texts
that start with spaces or follow a special token, where llama.cpp and transformers part. For each
text it records transformers' ids without special tokens, its decode of them (with and without
special tokens), and for some texts the ids with BOS added.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))

from make_gemma_tokenizer_fixtures import corpus, write_outputs  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "gguf_tokenizers" / "llama-spm.json"
SOURCE = "ggml-vocab-llama-spm.gguf"

SPM_TEXTS = [
    "<s>[INST] What is 2+2? [/INST]",
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello!</s><s>[INST] And you? [/INST]",
    "<s>hello",
    "<s> hello",
    "<s>  hello",
    "hello</s>",
    "hello</s> world",
    "hello</s>world",
    "a<unk>b",
    "<unk> <s> </s>",
    "<s></s><s>",
    "text with <s> inside and </s> again",
    "<s\n>",
    " hello",
    "  hello",
    "   hello world  ",
    "\nhello",
    "\n hello",
    "▁hello",
    " ▁ hello",
    "<0x0A> is a byte piece's name",
]
WITH_BOS = ["Hello world", "", " leading space", "<s>already", "[INST] hi [/INST]"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp-models", type=Path, default=None, help="llama.cpp's models/ folder")
    args = parser.parse_args()
    if args.llama_cpp_models is None:  # the tests' fetcher needs base installed
        from tests.llama_cpp_files import fetch_models_dir

    models = args.llama_cpp_models or fetch_models_dir()[0]
    write_outputs(models / SOURCE, list(dict.fromkeys([*corpus(models), *SPM_TEXTS])), WITH_BOS, OUT)


if __name__ == "__main__":
    main()
