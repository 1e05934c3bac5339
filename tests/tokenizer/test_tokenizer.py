"""Tokenizer: encode/decode equal transformers' on fixture tokenizers and SmolLM2; HF folders and files."""

from __future__ import annotations

import json
import shutil

import pytest

from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.tokenizer import Tokenizer
from tests.paths import BPE_TOKENIZER
from tests.tokenizer.conftest import (
    ALL_NAMES,
    CONVERSATIONS,
    CORPUS,
    EXPECTED,
    expected,
    load,
    render,
)

# ---- encode / decode against transformers ---------------------------------------------------


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_encode_equals_transformers_on_edge_case_corpus(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])
    got = [tokenizer.encode(text) for text in CORPUS]
    got_plain = [tokenizer.encode(text, add_special_tokens=False) for text in CORPUS]
    assert [(t, g) for t, g, w in zip(CORPUS, got, want["encode"]) if g != w] == []
    assert [(t, g) for t, g, w in zip(CORPUS, got_plain, want["encode_plain"]) if g != w] == []


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_decode_equals_transformers_with_and_without_special_tokens(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])
    decoded = [tokenizer.decode(ids) for ids in want["encode"]]
    skipped = [tokenizer.decode(ids, skip_special_tokens=True) for ids in want["encode"]]
    assert decoded == want["decode"]
    assert skipped == want["decode_skip"]


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_vocab_size_and_special_ids_equal_transformers(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])
    assert tokenizer.vocab_size == want["vocab_size"]
    assert tokenizer.bos_token_id == want["bos_token_id"]
    assert tokenizer.eos_token_ids[0] == want["eos_token_id"]


def test_bos_is_added_only_when_the_config_says_so():
    assert load("spm").encode("hello")[0] == 1  # tokenizer.json's post-processor adds <s>
    assert load("spm.gguf").encode("hello")[0] == 1  # tokenizer.ggml.add_bos_token: true
    assert load("spm").encode("hello", add_special_tokens=False)[0] != 1
    assert load("bpe").encode("<|endoftext|>hi") == [0] + load("bpe").encode("hi")  # no BOS added


# ---- SmolLM2 reference prompts --------------------------------------------------------------


def test_smollm2_prompt_ids_equal_reference(smollm2_gguf, smollm2_reference):
    tok = load("smollm2", smollm2_gguf)
    for case in smollm2_reference["cases"]:
        if case["kind"] == "raw":
            ids = tok.encode(case["prompt"])
        else:
            ids = tok.encode_chat([{"role": "user", "content": case["prompt"]}], add_generation_prompt=True)
        assert ids == case["prompt_token_ids"], case["prompt"]


def test_smollm2_generated_text_equals_reference(smollm2_gguf, smollm2_reference):
    tok = load("smollm2", smollm2_gguf)
    for case in smollm2_reference["cases"]:
        assert tok.decode(case["generated_token_ids"]) == case["generated_text"]


def test_smollm2_eos_and_bos(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    assert tok.eos_token_ids == (2,)  # <|im_end|>
    assert tok.bos_token_id == 1 and tok.encode("hi")[0] != 1  # add_bos_token is false
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|im_start|>") == 1


# ---- chat prompts as ids ---------------------------------------------------------------------


def test_encode_chat_does_not_double_the_bos_the_template_writes():
    tok = load("spm.gguf")  # adds BOS, and its template starts with {{ bos_token }}
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1


def test_encode_chat_adds_bos_when_the_template_does_not_write_it():
    tokenizer_json, config = load("spm.gguf").to_hf_files()
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1] + tok.encode("hi", add_special_tokens=False)


# ---- folders and HF files --------------------------------------------------------------------


def test_folder_reads_chat_template_json_and_generation_eos_ids(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(BPE_TOKENIZER, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_folder(folder)
    case = CONVERSATIONS["multi_turn"]
    assert render(tok, case) == EXPECTED["tokenizers"]["bpe"]["chat"]["multi_turn"]["text"]
    assert tok.eos_token_ids == (2, 0)  # <|im_end|> from the config, then generation_config's [2, 0]


def test_explicit_add_bos_token_in_the_config_wins_over_tokenizer_json():
    tokenizer_json = (BPE_TOKENIZER / "tokenizer.json").read_text()
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert tok.add_bos_token
    assert tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False)


def test_with_eos_ids_adds_ids_and_leaves_the_original_alone():
    tok = load("spm.gguf")
    more = tok.with_eos_ids([4, 2])
    assert more.eos_token_ids == (2, 4)
    assert tok.eos_token_ids == (2,)


def test_gguf_tokenizer_survives_a_round_trip_through_hf_files():
    tok = load("spm.gguf")
    again = Tokenizer.from_hf_files(*tok.to_hf_files())
    assert [again.encode(t) for t in CORPUS] == [tok.encode(t) for t in CORPUS]
    want = EXPECTED["tokenizers"]["spm.gguf"]["chat"]["multi_turn"]["text"]
    assert render(again, CONVERSATIONS["multi_turn"]) == want


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
