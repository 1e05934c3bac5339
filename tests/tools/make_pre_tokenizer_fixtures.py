"""Writes transformers' ids for one byte-level vocabulary under many `tokenizer.ggml.pre` names:
tests/fixtures/gguf_tokenizers/pre-tokenizers.json.

Dev tool: needs `transformers` (the `fixtures` extra). For each name it writes a copy of
tests/fixtures/tokenizers/bpe-gpt2.gguf with `tokenizer.ggml.pre` set to it, loads that with
`AutoTokenizer.from_pretrained(..., gguf_file=...)` and records the ids (no special tokens) of the
Gemma corpus's texts up to 200 characters (make_gemma_tokenizer_fixtures.py: edge cases,
llama.cpp's test texts, code, scripts, emoji), or the earlier name that has the same ids. The
names are those transformers gives a split of its own, which base reads.

    python tests/tools/make_pre_tokenizer_fixtures.py --llama-cpp-models DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_rewrite import rewrite_gguf  # noqa: E402
from make_gemma_tokenizer_fixtures import FIXTURES, ROOT, corpus  # noqa: E402

TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"  # the vocabularies of make_tokenizer_fixtures.py
SOURCE = TOKENIZERS / "bpe-gpt2.gguf"
OUT = FIXTURES / "pre-tokenizers.json"
NAMES = [
    "default", "gpt-2", "phi-2", "mpt", "olmo",
    "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe",
    "tekken", "qwen2", "deepseek-r1-qwen", "kormo", "megrez", "qwen35",
    "gpt-4o", "llama4", "kanana2", "minimax-m2",
]  # fmt: skip


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp-models", type=Path, required=True, help="llama.cpp's models/ folder")
    args = parser.parse_args()
    texts = [t for t in corpus(args.llama_cpp_models) if len(t) <= 200]  # the long ones add size, not cases
    result = {"source": SOURCE.name, "transformers": transformers.__version__, "texts": texts, "ids": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            path = Path(tmp) / f"bpe-{name}.gguf"
            rewrite_gguf(SOURCE, path, keys={"tokenizer.ggml.pre": name})
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            ids = [tok.encode(t, add_special_tokens=False) for t in texts]
            # A name whose ids equal an earlier one's names it instead: the file stays small.
            same = [k for k, v in result["ids"].items() if v == ids]
            result["ids"][name] = same[0] if same else ids
        # Phi-3's SentencePiece vocabulary: transformers puts "▁" before every run of text, as base does.
        path = Path(tmp) / "spm-phi3.gguf"
        rewrite_gguf(TOKENIZERS / "spm.gguf", path, keys={"general.architecture": "phi3"})
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
        result["phi3"] = [tok.encode(t, add_special_tokens=False) for t in texts]
    rows = ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in result["ids"].items())
    head = json.dumps({k: v for k, v in result.items() if k not in ("ids", "phi3")}, ensure_ascii=False)[:-1]
    head += ',\n"phi3": ' + json.dumps(result["phi3"])
    OUT.write_text(f'{head},\n"ids": {{\n{rows}\n}}}}\n', encoding="utf-8")
    print(f"{OUT}: {len(NAMES)} names, {len(texts)} texts")


if __name__ == "__main__":
    main()
