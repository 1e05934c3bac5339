"""Tokenizer: encode/decode and chat templates equal transformers' on fixture tokenizers and
SmolLM2; the streaming detokenizer's deltas add up to decode and never split a character.

Expected outputs come from transformers (tests/fixtures/tokenizers/expected.json, made by
scripts/make_tokenizer_fixtures.py) and from the shared SmolLM2 reference file.
"""

from __future__ import annotations

import json
import random
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
CORPUS: list[str] = EXPECTED["corpus"]
CONVERSATIONS: dict = EXPECTED["conversations"]
FIXTURE_NAMES = list(EXPECTED["tokenizers"])
ALL_NAMES = [*FIXTURE_NAMES, "smollm2"]

_cache: dict[str, Tokenizer] = {}


def load(name: str, smollm2_gguf: Path | None = None) -> Tokenizer:
    """A fixture tokenizer by name: an HF folder, a GGUF file, or SmolLM2's GGUF."""
    if name not in _cache:
        if name == "smollm2":
            _cache[name] = Tokenizer.from_gguf_metadata(read_metadata(smollm2_gguf)[1])
        elif name.endswith(".gguf"):
            _cache[name] = Tokenizer.from_gguf_metadata(read_metadata(FIXTURES / name)[1])
        else:
            _cache[name] = Tokenizer.from_folder(FIXTURES / name)
    return _cache[name]


@pytest.fixture
def tokenizer(request) -> Tokenizer:
    """The tokenizer named by the test's parameter; only SmolLM2's needs the real model file."""
    if request.param == "smollm2":
        return load("smollm2", request.getfixturevalue("smollm2_gguf"))
    return load(request.param)


def expected(name: str) -> dict:
    return EXPECTED["smollm2"] if name == "smollm2" else EXPECTED["tokenizers"][name]


def render(tok: Tokenizer, case: dict) -> str:
    return tok.apply_chat_template(
        case["messages"], add_generation_prompt=case.get("add_generation_prompt", True), tools=case.get("tools")
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


def test_pre_tokenizer_names_pick_their_split_of_digits():
    # One vocabulary, four `tokenizer.ggml.pre`: GPT-2 lets BPE merge across digits, llama-bpe
    # cuts numbers into runs of at most three digits first, qwen2 and smollm into single digits.
    def pieces(pre: str) -> list[str]:
        tok = load(f"bpe-{pre}.gguf")
        return [tok.id_to_token(i) for i in tok.encode("in 2024, 31415926")]

    assert pieces("gpt2") == ["in", "Ġ2024", ",", "Ġ314", "15", "9", "2", "6"]
    assert pieces("llama-bpe") == ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "3", "14", "15", "9", "2", "6"]
    singles = ["in", "Ġ", "2", "0", "2", "4", ",", "Ġ", "3", "1", "4", "1", "5", "9", "2", "6"]
    assert pieces("qwen2") == singles
    assert pieces("smollm") == singles


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


# ---- chat templates ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_chat_template_renders_like_transformers(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])["chat"]
    for name, case in CONVERSATIONS.items():
        if "error" in want[name] or name == "content_parts":
            continue
        assert render(tokenizer, case) == want[name]["text"], name
        ids = tokenizer.encode_chat(
            case["messages"], add_generation_prompt=case.get("add_generation_prompt", True), tools=case.get("tools")
        )
        assert ids == want[name]["ids"], name


@pytest.mark.parametrize("tokenizer", ALL_NAMES, indirect=True)
def test_conversations_transformers_refuses_raise_chat_template_error(tokenizer, request):
    want = expected(request.node.callspec.params["tokenizer"])["chat"]
    refused = [n for n in CONVERSATIONS if "error" in want[n] and n != "content_parts"]
    for name in refused:
        with pytest.raises(ChatTemplateError):
            render(tokenizer, CONVERSATIONS[name])


def test_template_raise_exception_message_reaches_the_caller():
    case = CONVERSATIONS["tool_role"]  # user, assistant, tool: the [INST] template wants alternation
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate user/assistant"):
        render(load("spm"), case)


def test_content_parts_pass_to_templates_that_iterate_them():
    case = CONVERSATIONS["content_parts"]
    assert render(load("bpe"), case) == EXPECTED["tokenizers"]["bpe"]["chat"]["content_parts"]["text"]


def test_content_parts_are_joined_for_string_only_templates(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    parts = CONVERSATIONS["content_parts"]["messages"]
    joined = [{"role": "user", "content": "Part one. \nPart two."}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(joined)
    tail = "<|im_start|>user\nPart one. \nPart two.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(joined).endswith(tail)


def test_tool_call_arguments_as_json_string_render_like_a_dict():
    case = json.loads(json.dumps(CONVERSATIONS["tool_call"]))
    case["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert render(load("bpe"), case) == EXPECTED["tokenizers"]["bpe"]["chat"]["tool_call"]["text"]


def test_encode_chat_does_not_double_the_bos_the_template_writes():
    tok = load("spm.gguf")  # adds BOS, and its template starts with {{ bos_token }}
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1


def test_encode_chat_adds_bos_when_the_template_does_not_write_it():
    tokenizer_json, config = load("spm.gguf").to_hf_files()
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1] + tok.encode("hi", add_special_tokens=False)


def with_template(template: str) -> Tokenizer:
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config["chat_template"] = template
    return Tokenizer.from_hf_files(tokenizer_json, config)


def test_template_helpers_strftime_now_generation_tag_and_tojson():
    tok = with_template(
        "{{ strftime_now('%Y') }}|{% generation %}{{ messages[0].content }}{% endgeneration %}|"
        "{{ {'k': 'é', 'n': [1]} | tojson(indent=1) }}|{{ bos_token }}{{ eos_token }}"
    )
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert text == f'{datetime.now().year}|x|{{\n "k": "é",\n "n": [\n  1\n ]\n}}|<|endoftext|><|im_end|>'


def test_template_variables_from_extra_arguments():
    tok = with_template("{% if enable_thinking %}think{% else %}plain{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=True) == "think"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


def test_templates_run_sandboxed_and_cannot_mutate_messages():
    tok = with_template("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="failed on this conversation"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_invalid_template_and_missing_template_are_clear_errors():
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        with_template("{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config.pop("chat_template")
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


def test_named_templates_pick_tool_use_when_tools_are_given():
    tokenizer_json, config = load("bpe-gpt2.gguf").to_hf_files()
    config["chat_template"] = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools"


# ---- folders and GGUF metadata ----------------------------------------------------------------


def test_folder_reads_chat_template_json_and_generation_eos_ids(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "bpe", folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_folder(folder)
    case = CONVERSATIONS["multi_turn"]
    assert render(tok, case) == EXPECTED["tokenizers"]["bpe"]["chat"]["multi_turn"]["text"]
    assert tok.eos_token_ids == (2, 0)  # <|im_end|> from the config, then generation_config's [2, 0]


def test_explicit_add_bos_token_in_the_config_wins_over_tokenizer_json():
    tokenizer_json = (FIXTURES / "bpe" / "tokenizer.json").read_text()
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    tok = Tokenizer.from_hf_files(tokenizer_json, config)
    assert tok.add_bos_token
    assert tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False)


def test_with_eos_ids_adds_ids_and_leaves_the_original_alone():
    tok = load("spm.gguf")
    more = tok.with_eos_ids([4, 2])
    assert more.eos_token_ids == (2, 4)
    assert tok.eos_token_ids == (2,)


def test_gguf_end_of_turn_id_ends_generation_too():
    metadata = dict(read_metadata(FIXTURES / "bpe-gpt2.gguf")[1])
    metadata["tokenizer.ggml.eot_token_id"] = 1
    assert Tokenizer.from_gguf_metadata(metadata).eos_token_ids == (2, 1)


def test_gguf_tokenizer_survives_a_round_trip_through_hf_files():
    tok = load("spm.gguf")
    again = Tokenizer.from_hf_files(*tok.to_hf_files())
    assert [again.encode(t) for t in CORPUS] == EXPECTED["tokenizers"]["spm.gguf"]["encode"]
    want = EXPECTED["tokenizers"]["spm.gguf"]["chat"]["multi_turn"]["text"]
    assert render(again, CONVERSATIONS["multi_turn"]) == want


def test_unknown_gguf_pre_tokenizer_and_model_are_refused():
    metadata = dict(read_metadata(FIXTURES / "bpe-gpt2.gguf")[1])
    with pytest.raises(TokenizerError, match="pre-tokenizer 'made-up' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "made-up"})
    with pytest.raises(TokenizerError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "t5"})
    with pytest.raises(TokenizerError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


# ---- streaming detokenizer ----------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.finish()]


def id_sequences(tok: Tokenizer, seed: int) -> list[list[int]]:
    """The corpus encoded, random id sequences, and random runs rich in <0xNN> byte tokens."""
    rng = random.Random(seed)
    seqs = [tok.encode(text) for text in CORPUS]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    byte_ids = sorted(tok.byte_fallback_ids)
    if byte_ids:
        seqs += [
            [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(30)]
            for _ in range(150)
        ]
    return seqs


@pytest.mark.parametrize("tokenizer", ["bpe", "spm", "spm.gguf", "smollm2"], indirect=True)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_detokenizer_deltas_add_up_to_decode(tokenizer, skip_special_tokens):
    for ids in id_sequences(tokenizer, seed=int(skip_special_tokens)):
        deltas = stream(tokenizer, ids, skip_special_tokens)
        # Every delta is the full decode's text at its place: a U+FFFD in a delta is one decode has there.
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_detokenizer_holds_byte_fallback_runs_until_the_character_completes():
    tok = load("spm")
    ids = tok.encode("a😀b")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "b"]
    assert stream(tok, ids) == ["<s>", " a", "", "", "", "", "😀b", ""]
    assert stream(tok, ids, skip_special_tokens=True) == ["", "a", "", "", "", "", "😀b", ""]


def test_detokenizer_holds_byte_level_pieces_until_the_character_completes(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    ids = tok.encode("a😀b 日本")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ðŁ", "ĺ", "Ģ", "b", "Ġæ", "Ĺ", "¥", "æľ¬"]
    assert stream(tok, ids) == ["a", "", "", "😀", "b", " ", "", "日", "本", ""]


def test_detokenizer_finish_flushes_an_incomplete_tail_as_decode_does(smollm2_gguf):
    tok = load("smollm2", smollm2_gguf)
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte piece never comes
    deltas = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


def test_templates_that_only_type_test_content_get_joined_text():
    # Some templates render '' for non-string content; only a loop over content takes parts.
    tok = with_template(
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}?{% endif %}{% endfor %}"
    )
    assert tok.apply_chat_template(CONVERSATIONS["content_parts"]["messages"]) == "Part one. \nPart two."


def test_templates_that_loop_over_content_through_a_variable_get_parts():
    tok = with_template(
        "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endfor %}"
    )
    assert tok.apply_chat_template(CONVERSATIONS["content_parts"]["messages"]) == "[Part one. ][Part two.]"


def test_gguf_sentencepiece_without_space_prefix_adds_no_leading_space():
    metadata = {**read_metadata(FIXTURES / "spm.gguf")[1], "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_gguf_metadata(metadata)
    with_prefix = load("spm.gguf")
    assert with_prefix.id_to_token(with_prefix.encode("hello", add_special_tokens=False)[0]).startswith("▁")
    assert not tok.id_to_token(tok.encode("hello", add_special_tokens=False)[0]).startswith("▁")
    assert tok.decode(tok.encode(" hi", add_special_tokens=False)) == " hi"


def test_gguf_sentencepiece_of_gemma_is_refused_rather_than_guessed():
    metadata = {**read_metadata(FIXTURES / "spm.gguf")[1], "general.architecture": "gemma2"}
    with pytest.raises(TokenizerError, match="'gemma2' models are not supported"):
        Tokenizer.from_gguf_metadata(metadata)
