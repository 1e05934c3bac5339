"""Renders SmolLM3's and gpt-oss's real chat templates with their reasoning switches, as transformers does.

Dev tool: needs `transformers`, which the package and the tests never import.

    python tests/tools/make_reasoning_template_fixtures.py [MODELS_DIR]

MODELS_DIR is llama.cpp's `models/` folder as tests/llama_cpp_files.py extracts it from
llama-cpp-python's sdist (default: under ~/.cache/base/downloads). Each case renders one
template through `apply_chat_template` of the `bpe` fixture tokenizer with the case's template
variables (SmolLM3's `enable_thinking`, gpt-oss's `reasoning_effort`, `builtin_tools`,
`model_identity`) and strftime_now() pinned; the texts go to
tests/fixtures/chat_templates/reasoning_flags.json with each template's sha256.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as chat_template_utils
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "chat_templates" / "reasoning_flags.json"
DEFAULT_MODELS = Path.home() / ".cache" / "base" / "downloads" / "llama-cpp-python-0.3.36" / "models"
NOW = "2026-01-15T12:00:00"

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}
CHAT = [SYSTEM, USER, ASSISTANT, FOLLOW_UP]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "role": "assistant",
    "thinking": "The user wants the weather; call the tool.",
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
RESULT = {"role": "tool", "name": "get_weather", "content": '{"temp": 21}'}

# name -> (template file, messages, tools, add_generation_prompt, template variables)
CASES = {
    "smollm3_thinking_by_default": ("HuggingFaceTB-SmolLM3-3B.jinja", CHAT, None, True, {}),
    "smollm3_enable_thinking_false": ("HuggingFaceTB-SmolLM3-3B.jinja", CHAT, None, True, {"enable_thinking": False}),
    "smollm3_no_think_in_system": (
        "HuggingFaceTB-SmolLM3-3B.jinja",
        [{"role": "system", "content": "Be brief. /no_think"}, USER],
        None,
        True,
        {},
    ),
    "smollm3_think_in_system_wins": (
        "HuggingFaceTB-SmolLM3-3B.jinja",
        [{"role": "system", "content": "/think"}, USER, ASSISTANT, FOLLOW_UP],
        None,
        False,
        {"enable_thinking": False},
    ),
    "gpt_oss_default": ("openai-gpt-oss-120b.jinja", CHAT, None, True, {}),
    "gpt_oss_reasoning_high": ("openai-gpt-oss-120b.jinja", CHAT, None, True, {"reasoning_effort": "high"}),
    "gpt_oss_tool_call_with_thinking": (
        "openai-gpt-oss-120b.jinja",
        [SYSTEM, USER, CALL, RESULT],
        [WEATHER_TOOL],
        True,
        {"reasoning_effort": "low"},
    ),
    "gpt_oss_final_answer_with_thinking": (
        "openai-gpt-oss-120b.jinja",
        [USER, {"role": "assistant", "content": "Paris.", "thinking": "France's capital is Paris."}],
        None,
        False,
        {},
    ),
    "gpt_oss_builtin_tools_and_identity": (
        "openai-gpt-oss-120b.jinja",
        [USER],
        None,
        True,
        {"builtin_tools": ["browser", "python"], "model_identity": "You are a tiny test model."},
    ),
}


class _PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ARG003
        return datetime.fromisoformat(NOW)


def main() -> None:
    models = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODELS
    chat_template_utils.datetime = _PinnedClock
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tests" / "fixtures" / "tokenizers" / "bpe")
    cases, hashes = {}, {}
    for name, (file, messages, tools, add_generation_prompt, variables) in CASES.items():
        template = (models / "templates" / file).read_text(encoding="utf-8")
        hashes[file] = hashlib.sha256(template.encode()).hexdigest()
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **variables,
        )
        cases[name] = {
            "template": file,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "variables": variables,
            "text": text,
        }
    expected = {"transformers": transformers.__version__, "now": NOW, "sha256": hashes, "cases": cases}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
