"""A tiny random Qwen2 GGUF with Qwen2.5's real vocabulary and chat template, tool tokens included.

The vocabulary is llama.cpp's `ggml-vocab-qwen2.gguf` (151,936 ids: Qwen2's byte-level BPE and
merges), with Qwen2.5's added tokens put in the places its `tokenizer.json` gives them: the
`<|...|>` controls as CONTROL tokens and `<tool_call>`, `</tool_call>` and the FIM tokens as
USER_DEFINED, as llama.cpp's converter types tokens that are added but not special. The template
is llama.cpp's copy of Qwen2.5-7B-Instruct's. The weights are the qwen2 fixture's, under a random
embedding for the whole vocabulary (tied to the output): the model says nothing sensible, which is
the point: only a grammar can make its calls parse.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from baselm.store.gguf import GGUFFile
from tests.paths import FIXTURES
from tests.tiny_gguf import add_hparams, converter_tensors, encode, write_gguf

QWEN2_FIXTURE = FIXTURES / "models" / "qwen2"
CONTROL, USER_DEFINED = 3, 4
VOCAB_SIZE = 151_936
IM_END, ENDOFTEXT = 151_645, 151_643
# Qwen2.5's added tokens past <|im_end|>, by id: (text, GGUF token type)
ADDED = {
    151_646 + i: (text, CONTROL)
    for i, text in enumerate(
        (
            "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
        )
    )
}  # fmt: skip
ADDED |= {
    151_657 + i: (text, USER_DEFINED)
    for i, text in enumerate(
        (
            "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
            "<|repo_name|>", "<|file_sep|>",
        )
    )
}  # fmt: skip
TOOL_CALL, TOOL_CALL_END = 151_657, 151_658
QWEN25_TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"


FIRST_FREE = 151_665  # the first of the vocabulary's padding ids, which `markers` may take


def qwen25_tool_gguf(
    path: Path, llama_cpp_models: Path, template: str = QWEN25_TEMPLATE, markers: tuple[str, ...] = ()
) -> Path:
    """Writes the model to `path` (F16 matrices, about 20 MB) and returns it: with another of llama.cpp's
    templates (a file name in its templates/) and `markers` as CONTROL tokens from id FIRST_FREE on, it
    stands for a model of another tool-call format."""
    config = {**_config(), "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096}
    weights = load_file(str(QWEN2_FIXTURE / "model.safetensors"))
    rng = np.random.default_rng(0)
    weights["model.embed_tokens.weight"] = rng.normal(0, 0.5, (VOCAB_SIZE, config["hidden_size"])).astype(np.float32)
    added = {FIRST_FREE + i: (text, CONTROL) for i, text in enumerate(markers)}
    return qwen25_vocab_gguf(path, llama_cpp_models, config, weights, "qwen2", template=template, added=added)


def qwen25_vocab_gguf(
    path: Path,
    llama_cpp_models: Path,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    arch: str,
    more: Callable[[gguf.GGUFWriter], None] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    tensor_types: dict[str, str] | None = None,
    template: str = QWEN25_TEMPLATE,
    added: dict[int, tuple[str, int]] | None = None,
) -> Path:
    """`weights` (HF names, float32, the vocabulary's size) as the converter writes a model of `arch`
    with Qwen2.5's vocabulary and template, F16 matrices unless `tensor_types` names another type for a
    tensor (by GGUF name); `more` adds metadata, `extra_tensors` tensors under their GGUF names; `template`
    names another of llama.cpp's templates, `added` more tokens by id (text, GGUF token type)."""
    vocab = GGUFFile.open(llama_cpp_models / "ggml-vocab-qwen2.gguf").metadata
    tokens = list(vocab["tokenizer.ggml.tokens"])
    types = list(vocab["tokenizer.ggml.token_type"])
    for i, (text, kind) in {**ADDED, **(added or {})}.items():
        tokens[i], types[i] = text, kind
    template_text = (llama_cpp_models / "templates" / template).read_text(encoding="utf-8")
    tensors = {}
    for name, value in {**converter_tensors(config, weights), **(extra_tensors or {})}.items():
        kind = (tensor_types or {}).get(name) or ("F16" if value.ndim >= 2 else "F32")
        tensors[name] = (encode(value, kind), kind)

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_hparams(writer, config)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(list(vocab["tokenizer.ggml.merges"]))
        writer.add_eos_token_id(IM_END)
        writer.add_pad_token_id(ENDOFTEXT)
        writer.add_bos_token_id(ENDOFTEXT)
        writer.add_add_bos_token(False)
        writer.add_chat_template(template_text)
        if more is not None:
            more(writer)

    return write_gguf(path, tensors, metadata, arch=arch)


def _config() -> dict:
    import json

    return json.loads((QWEN2_FIXTURE / "config.json").read_text())
