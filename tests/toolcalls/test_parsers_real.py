"""Tool calls as real chat templates write them (llama.cpp's collection) are read back by their parser.

For each template, the assistant turn holding tool calls is rendered with base's renderer and
cut off the prompt the way the model would write it; the parser of the template's detected
format must give back exactly the calls that went in, whole and streamed.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from baselm.store.gguf import read_metadata
from baselm.tokenizer.errors import ChatTemplateError
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls.markers import UNSUPPORTED, detect_format, needs_special_tokens
from baselm.toolcalls.parsers import make_parser
from tests.paths import BPE_TOKENIZER, FIXTURES

EXPECTED = json.loads((FIXTURES / "chat_templates" / "expected.json").read_text(encoding="utf-8"))
SCENARIOS = EXPECTED["scenarios"]
TOOLS = SCENARIOS["tools"]["tools"]
QUESTION = SCENARIOS["tools"]["messages"][-1]
ONE_CALL = SCENARIOS["tool_call"]["messages"][1]
TWO_CALLS = SCENARIOS["parallel_tool_calls"]["messages"][2]
# Tokens that end an assistant turn: stop tokens, which the model's answer does not carry.
END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "</s>", "<|end|>", "<|call|>"]

DETECTED = {
    "Apertus-8B-Instruct.jinja": "apertus",
    "Apriel-1.6-15b-Thinker-fixed.jinja": "tool_calls_json",
    "Bielik-11B-v3.0-Instruct.jinja": "hermes",
    "ByteDance-Seed-OSS.jinja": "seed_oss",
    "Cohere2MoE.jinja": "cohere",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "cohere_command_r",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "cohere",
    "GLM-4.6.jinja": "glm",
    "GLM-4.7-Flash.jinja": "glm",
    "GigaChat3-10B-A1.8B.jinja": "gigachat_3",
    "GigaChat3.1-10B-A1.8B.jinja": "gigachat_3_1",
    "HuggingFaceTB-SmolLM3-3B.jinja": "hermes",
    "Kimi-K2-Instruct.jinja": "kimi_k2",
    "Kimi-K2-Thinking.jinja": "kimi_k2",
    "Kimi-K3.jinja": "kimi_k3",
    "LFM2-8B-A1B.jinja": "lfm2",
    "LFM2.5-8B-A1B.jinja": "lfm2",
    "LFM2.5-Instruct.jinja": "hermes",
    "MiMo-VL.jinja": "hermes",
    "MiniMax-M1.jinja": "tool_calls_json",
    "MiniMax-M2.jinja": "minimax_m2",
    "MiniMax-M3.jinja": "minimax_m3",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "qwen3_xml",
    "NVIDIA-Nemotron-Nano-v2.jinja": "nemotron_json",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "Qwen-QwQ-32B.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_xml",
    "Qwen3.5-4B.jinja": "qwen3_xml",
    "Reka-Edge.jinja": "hermes",
    "Spark2.5.jinja": "glm",
    "StepFun3.5-Flash.jinja": "qwen3_xml",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_v3_2",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "deepseek_v4",
    "deepseek-ai-DeepSeek-V4.jinja": "deepseek_v4",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "firefunction_v2",
    "google-gemma-2-2b-it.jinja": "hermes",
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "google-gemma-4-31B-it.jinja": "gemma4",
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "granite_3",
    "ibm-granite-granite-4.0.jinja": "hermes",
    "ibm-granite-granite-4.1.jinja": "hermes",
    "inclusionai-ling-3.0-flash.jinja": "glm",
    "llama-cpp-deepseek-r1.jinja": "deepseek",
    "llama-cpp-rwkv-world.jinja": "hermes",
    "meetkai-functionary-medium-v3.1.jinja": "functionary_v3_1",
    "meetkai-functionary-medium-v3.2.jinja": "functionary_v3_2",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
    "microsoft-Phi-3.5-mini-instruct.jinja": "hermes",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "moonshotai-Kimi-K2.jinja": "kimi_k2",
    "muse-glimmer.jinja": "muse",
    "openai-gpt-oss-120b.jinja": "harmony",
    "openbmb-MiniCPM5-1B.jinja": "minicpm5",
    "poolside-Laguna-S-2.1.jinja": "glm",
    "poolside-Laguna-XS-2.1.jinja": "glm",
    "poolside-Laguna-XS.2.jinja": "glm",
    "tencent-Hy3.jinja": "hunyuan_3",
    "unsloth-Apriel-1.5.jinja": "tool_calls_json",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral",
    "upstage-Solar-Open-100B.jinja": "solar_open",
}


def tokenizer_with(template: str) -> Tokenizer:
    config = json.loads((BPE_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_json = (BPE_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8")
    return Tokenizer.from_hf_files(tokenizer_json, config, chat_template=template)


def rendered_answer(tok: Tokenizer, message: dict) -> str:
    """The assistant turn as the model writes it: the conversation less the prompt before it, less end-of-turn tokens.

    The prompt may differ from the turn's start (a generation prompt that opens `<think>`, say):
    the answer then starts after the last `>` or newline the two share.
    """
    full = tok.apply_chat_template([QUESTION, message], add_generation_prompt=False, tools=TOOLS)
    prompt = tok.apply_chat_template([QUESTION], add_generation_prompt=True, tools=TOOLS)
    shared = len(os.path.commonprefix([prompt, full]))
    if shared < len(prompt):
        shared = max(full.rfind(">", 0, shared), full.rfind("\n", 0, shared)) + 1
    answer = full[shared:].rstrip()
    while any(answer.endswith(end) for end in END_OF_TURN):
        answer = next(answer[: -len(end)].rstrip() for end in END_OF_TURN if answer.endswith(end))
    return answer


def parse(fmt: str, pieces: list[str]) -> list[tuple[str, dict]]:
    parser = make_parser(fmt, tools=TOOLS)
    calls = [c for piece in pieces for c in parser.feed(piece)[1]] + parser.finish()[1]
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_every_shipped_template_is_in_the_table(llama_cpp_models):
    assert {p.name for p in (llama_cpp_models / "templates").glob("*.jinja")} == set(DETECTED)


@pytest.mark.parametrize(("name", "fmt"), sorted(DETECTED.items()))
def test_format_detected_from_the_real_template(llama_cpp_models, name, fmt):
    assert detect_format((llama_cpp_models / "templates" / name).read_text(encoding="utf-8")) == fmt


SUPPORTED = sorted(name for name, fmt in DETECTED.items() if fmt not in UNSUPPORTED)


@pytest.mark.parametrize("message", [ONE_CALL, TWO_CALLS], ids=["one_call", "two_calls"])
@pytest.mark.parametrize("name", SUPPORTED)
def test_calls_a_real_template_writes_are_read_back(llama_cpp_models, name, message):
    tok = tokenizer_with((llama_cpp_models / "templates" / name).read_text(encoding="utf-8"))
    try:
        answer = rendered_answer(tok, message)
    except ChatTemplateError as exc:
        pytest.skip(f"the template refuses this conversation (as transformers does): {exc}")
    # Expected: the calls the template wrote (gpt-oss writes only the first of a turn's calls).
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    want = [(n, a) for n, a in want if n in answer]
    if not want:
        pytest.skip("the template does not write assistant tool calls")
    fmt = DETECTED[name]
    assert parse(fmt, [answer]) == want, answer
    rng = random.Random(3)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(answer)), k=8))
        assert parse(fmt, [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]) == want


def test_gemma4_call_markers_are_plain_tokens_so_they_survive_decoding(llama_cpp_models):
    # Only special tokens are skipped in decoding; Gemma 4's call markers are user-defined ones.
    tok = Tokenizer.from_gguf_metadata(read_metadata(llama_cpp_models / "ggml-vocab-gemma-4.gguf")[1])
    assert not needs_special_tokens("gemma4", tok)
    ids = tok.encode('<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>', add_special_tokens=False)
    assert parse("gemma4", [tok.decode(ids, skip_special_tokens=True)]) == [("f", {"a": "x"})]
