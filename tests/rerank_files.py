"""A tiny Qwen3-Reranker GGUF laid out as llama.cpp's converter writes one, and its causal twin.

llama.cpp's converter (`conversion/qwen.py`, `Qwen3Model` with `is_rerank`) writes a Qwen3-Reranker
as a qwen3 model whose LM head is cut down to a classification head: `cls.output.weight` holds the
head's rows of "yes" and "no", in that order (an untied head is left out, the embedding stays), with
`qwen3.pooling_type` RANK, `qwen3.classifier.output_labels` ["yes", "no"] and a chat template named
`rerank` that llama-server fills with the query and the document. llama-server's /rerank returns
the softmax of the head's two logits at the prompt's last token, taken at yes.

The twin is the same model before the cut: the untied LM head whole (`output.weight`), no head, no
rerank keys. A causal model's P(yes) against "no" there is what llama-server returns for the
reranker, which is how transformers, which reads no `cls.output`, gives the reference
(tests/tools/make_rerank_reference.py). Both have Qwen2.5's vocabulary (tests/toolcalls/qwen_vocab.py)
over the qwen3 model fixture's layers, with a random embedding and LM head for the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.paths import MODEL_FIXTURES
from tests.toolcalls.qwen_vocab import VOCAB_SIZE, qwen25_vocab_gguf

QWEN3_FIXTURE = MODEL_FIXTURES / "qwen3"
CLS_OUT = "cls.output.weight"
YES, NO = 9693, 2152  # "yes" and "no" in Qwen2.5's vocabulary
# The converter's rerank template, as `Qwen3Model.set_gguf_parameters` writes it.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def qwen3_reranker_gguf(path: Path, llama_cpp_models: Path, with_head: bool = True, head_type: str = "F16") -> Path:
    """Writes the reranker (`with_head`, its head of GGUF type `head_type`: llama-quantize quantizes
    `cls.output` with the body) or its causal twin to `path` (F16 matrices, about 40 MB)."""
    config = {
        **json.loads((QWEN3_FIXTURE / "config.json").read_text()),
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
    }
    weights = load_file(str(QWEN3_FIXTURE / "model.safetensors"))
    rng = np.random.default_rng(3)
    shape = (VOCAB_SIZE, config["hidden_size"])
    weights["model.embed_tokens.weight"] = rng.normal(0, 0.5, shape).astype(np.float32)
    weights["lm_head.weight"] = rng.normal(0, 0.5, shape).astype(np.float32)
    if not with_head:
        return qwen25_vocab_gguf(path, llama_cpp_models, config, weights, "qwen3")
    head = weights.pop("lm_head.weight")[[YES, NO]]  # (2, hidden)

    def rerank_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_array("qwen3.classifier.output_labels", ["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])

    extra, types = {CLS_OUT: head}, {CLS_OUT: head_type}
    return qwen25_vocab_gguf(path, llama_cpp_models, config, weights, "qwen3", rerank_keys, extra, types)
