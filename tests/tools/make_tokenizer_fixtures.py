"""Makes the tokenizer fixtures in tests/fixtures/tokenizers/ and their expected outputs.

Dev tool: needs `transformers` and `sentencepiece`, which the package and the tests never import.

    python tests/tools/make_tokenizer_fixtures.py [--smollm2 PATH_TO_GGUF]

It trains two small tokenizers on a built-in text, saves each as an HF folder (tokenizer.json,
tokenizer_config.json) and as GGUF files holding only tokenizer metadata (plus the few llama
header keys transformers needs to open them), then writes expected.json: transformers' ids,
decoded text and rendered chat templates for an edge-case corpus and a set of conversations,
for every fixture and for the SmolLM2 GGUF. The text, corpus, templates and conversations are
in tests/tools/tokenizer_fixture_cases.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import sentencepiece as spm
from tokenizer_fixture_cases import CHATML_TEMPLATE, CONVERSATIONS, CORPUS, INST_TEMPLATE, TRAINING_TEXT
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tokenizers"
SMOLLM2 = Path("/root/.cache/base/downloads/SmolLM2-135M-Instruct.Q4_1.gguf")

README = """\
# Tokenizer fixtures

Made by `tests/tools/make_tokenizer_fixtures.py` (deterministic; rerun it to regenerate all of this).

- `bpe/`: a GPT-2 kind byte-level BPE (700 tokens) trained with `tokenizers` on a small text:
  special `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, plain added `<think>`, `</think>`, a ChatML
  template with tools in `chat_template.jinja`, and a `generation_config.json` with two EOS ids.
- `bpe-<pre>.gguf`: the same vocabulary as GGUF tokenizer metadata, with `tokenizer.ggml.pre`
  set to gpt2, llama-bpe, qwen2 or smollm (each splits text, digits above all, differently).
- `spm/` and `spm.gguf`: a llama kind SentencePiece BPE (800 pieces, byte fallback, scores, no
  merges in the GGUF) trained with `sentencepiece`, with an [INST] template that writes `bos_token`.
  The folder is transformers' conversion of the sentencepiece model.
- `expected.json`: for each of these and for the SmolLM2 GGUF, transformers' ids, decoded text and
  rendered chat templates on an edge-case corpus and a set of conversations.

Every GGUF holds a one-row `token_embd.weight` only because `mx.load` wants a tensor.
"""


def train_bpe(text: str) -> Tokenizer:
    """A GPT-2 kind byte-level BPE with ChatML special tokens and one plain added token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True) * 3, trainer)
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    tok.add_tokens([AddedToken("</think>", normalized=False, special=False)])
    return tok


def save_bpe_folder(tok: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    generation = {"bos_token_id": tok.token_to_id("<|endoftext|>"), "eos_token_id": [2, 0]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def gguf_header(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The llama header keys transformers reads before it builds a GGUF tokenizer."""
    writer.add_name("tokenizer fixture")
    writer.add_context_length(256)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(8)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab_size)


def write_gguf(path: Path, tokenizer_meta: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_header(writer, len(tokenizer_meta["tokens"]))
    writer.add_tokenizer_model(tokenizer_meta["model"])
    if "pre" in tokenizer_meta:
        writer.add_tokenizer_pre(tokenizer_meta["pre"])
    writer.add_token_list(tokenizer_meta["tokens"])
    writer.add_token_types(tokenizer_meta["token_type"])
    if "scores" in tokenizer_meta:
        writer.add_token_scores(tokenizer_meta["scores"])
    if "merges" in tokenizer_meta:
        writer.add_token_merges(tokenizer_meta["merges"])
    writer.add_bos_token_id(tokenizer_meta["bos_id"])
    writer.add_eos_token_id(tokenizer_meta["eos_id"])
    if "unk_id" in tokenizer_meta:
        writer.add_unk_token_id(tokenizer_meta["unk_id"])
    writer.add_add_bos_token(tokenizer_meta["add_bos"])
    writer.add_add_eos_token(False)
    writer.add_chat_template(tokenizer_meta["chat_template"])
    # mx.load wants at least one tensor in a GGUF file.
    writer.add_tensor("token_embd.weight", np.zeros((1, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bpe_gguf_meta(tok: Tokenizer, pre: str) -> dict:
    state = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(vocab_size)]
    special = {t["content"]: t["special"] for t in state["added_tokens"]}
    token_type = [(3 if special[t] else 4) if t in special else 1 for t in tokens]
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "token_type": token_type,
        "merges": merges,
        "bos_id": tok.token_to_id("<|endoftext|>"),
        "eos_id": tok.token_to_id("<|im_end|>"),
        "add_bos": False,
        "chat_template": CHATML_TEMPLATE,
    }


def train_spm(text: str, folder: Path) -> spm.SentencePieceProcessor:
    """A llama kind SentencePiece BPE with byte fallback; rare characters fall back to bytes."""
    work = Path(tempfile.mkdtemp())
    (work / "train.txt").write_text(text * 3)
    spm.SentencePieceTrainer.train(
        input=str(work / "train.txt"),
        model_prefix=str(work / "spm"),
        model_type="bpe",
        vocab_size=800,
        byte_fallback=True,
        character_coverage=0.98,
        split_digits=True,
        user_defined_symbols=["<think>", "</think>"],
        control_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "spm.model", folder / "tokenizer.model")
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def spm_gguf_meta(sp: spm.SentencePieceProcessor) -> dict:
    tokens, scores, token_type = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            token_type.append(2)
        elif sp.is_control(i):
            token_type.append(3)
        elif sp.is_byte(i):
            token_type.append(6)
        elif piece in ("<think>", "</think>"):
            token_type.append(4)
        else:
            token_type.append(1)
    return {
        "model": "llama",
        "pre": "default",
        "tokens": tokens,
        "scores": scores,
        "token_type": token_type,
        "bos_id": 1,
        "eos_id": 2,
        "unk_id": 0,
        "add_bos": True,
        "chat_template": INST_TEMPLATE,
    }


def save_spm_folder(folder: Path) -> None:
    """The HF folder the way transformers converts a sentencepiece model: tokenizer.json + config."""
    hf = LlamaTokenizer.from_pretrained(str(folder), add_bos_token=True, legacy=False)
    hf.chat_template = INST_TEMPLATE
    hf.save_pretrained(str(folder))
    (folder / "tokenizer.model").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = INST_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (folder / extra).exists():
            (folder / extra).unlink()


def smollm_reference_tokenizer(bpe_folder: Path) -> PreTrainedTokenizerFast:
    """The fixture vocabulary with SmolLM2's own tokenizer.json pre-tokenizer: digits split, then GPT-2."""
    tok = Tokenizer.from_file(str(bpe_folder / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")


def expected_for(hf, conversations: dict) -> dict:
    encode, encode_plain, decode, decode_skip = [], [], [], []
    for text in CORPUS:
        ids = hf.encode(text)
        encode.append(ids)
        encode_plain.append(hf.encode(text, add_special_tokens=False))
        decode.append(hf.decode(ids))
        decode_skip.append(hf.decode(ids, skip_special_tokens=True))
    chats = {}
    for name, case in conversations.items():
        try:
            rendered = hf.apply_chat_template(
                case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=case.get("add_generation_prompt", True),
                tokenize=False,
            )
            chats[name] = {"text": rendered, "ids": hf.encode(rendered, add_special_tokens=False)}
        except Exception as exc:  # the template refuses this conversation
            chats[name] = {"error": str(exc)}
    return {
        "encode": encode,
        "encode_plain": encode_plain,
        "decode": decode,
        "decode_skip": decode_skip,
        "chat": chats,
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "vocab_size": len(hf),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", type=Path, default=SMOLLM2)
    args = parser.parse_args()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)

    bpe = train_bpe(TRAINING_TEXT)
    save_bpe_folder(bpe, OUT / "bpe")
    for pre in ("gpt2", "llama-bpe", "qwen2", "smollm"):
        write_gguf(OUT / f"bpe-{pre}.gguf", bpe_gguf_meta(bpe, pre))

    sp = train_spm(TRAINING_TEXT, OUT / "spm")
    write_gguf(OUT / "spm.gguf", spm_gguf_meta(sp))
    save_spm_folder(OUT / "spm")

    sources = {
        "bpe": AutoTokenizer.from_pretrained(str(OUT / "bpe")),
        "bpe-gpt2.gguf": AutoTokenizer.from_pretrained(str(OUT), gguf_file="bpe-gpt2.gguf"),
        "bpe-llama-bpe.gguf": AutoTokenizer.from_pretrained(str(OUT), gguf_file="bpe-llama-bpe.gguf"),
        "bpe-qwen2.gguf": AutoTokenizer.from_pretrained(str(OUT), gguf_file="bpe-qwen2.gguf"),
        # transformers gives `smollm` files the plain GPT-2 split; the model's own tokenizer.json
        # (and llama.cpp) first split digits, so the expected output comes from that pre-tokenizer.
        "bpe-smollm.gguf": smollm_reference_tokenizer(OUT / "bpe"),
        "spm": AutoTokenizer.from_pretrained(str(OUT / "spm")),
        "spm.gguf": AutoTokenizer.from_pretrained(str(OUT), gguf_file="spm.gguf"),
    }
    sources["bpe-smollm.gguf"].chat_template = CHATML_TEMPLATE
    expected = {"corpus": CORPUS, "conversations": CONVERSATIONS, "tokenizers": {}}
    for name, hf in sources.items():
        expected["tokenizers"][name] = expected_for(hf, CONVERSATIONS)
    if args.smollm2.is_file():
        hf = AutoTokenizer.from_pretrained(str(args.smollm2.parent), gguf_file=args.smollm2.name)
        # SmolLM2's own tokenizer.json splits digits first (llama.cpp's `smollm` does too);
        # transformers' GGUF loader does not, which differs on numerals like "½" or "²".
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        expected["smollm2"] = expected_for(hf, CONVERSATIONS)
    (OUT / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1) + "\n")
    (OUT / "README.md").write_text(README)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
