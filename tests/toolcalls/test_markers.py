"""Which call format a chat template teaches, and the formats and forcing base refuses."""

from __future__ import annotations

import pytest

from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.markers import DEEPSEEK, GLM, HARMONY, MISTRAL, QWEN3_XML, check_supported, detect_format
from baselm.toolcalls.parsers import HERMES, LLAMA3_JSON


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{{ '<|start|>assistant<|channel|>' }}...{{ '<|call|>' }}", HARMONY),
        ("{{ '<｜tool▁calls▁begin｜>' }}", DEEPSEEK),
        ("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", MISTRAL),
        ("<tool_call>\n<function={{ name }}>", QWEN3_XML),
        ("<tool_call>{{ name }}<arg_key>", GLM),
        ("<tool_call>{{ call | tojson }}</tool_call>", HERMES),
        ("{{ '<|python_tag|>' }}", LLAMA3_JSON),
        ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
        ("{{ '<|tool_call>call:' + name }}", "gemma4"),
        ("{{ '<|tool_call|>' + calls | tojson }}", "granite_3"),
        ("{{ '<|tool_call:begin|>' }}", "solar_open"),
        ("plain {{ messages }}", HERMES),
        (None, HERMES),
    ],
)
def test_format_is_detected_from_the_template_markers(template, fmt):
    assert detect_format(template) == fmt


def test_unsupported_formats_are_refused_clearly():
    with pytest.raises(ToolCallError, match="solar_open format .* does not parse yet") as caught:
        check_supported("solar_open")
    assert caught.value.param == "tools"
    check_supported(MISTRAL)
    check_supported(HERMES)


def test_format_follows_the_chat_template():
    assert detect_format("... <tool_call> ...") == HERMES
    assert detect_format("{{ '<|python_tag|>' }} parameters") == LLAMA3_JSON
    assert detect_format({"default": "x", "tool_use": "ipython ... parameters"}) == LLAMA3_JSON
    assert detect_format(None) == HERMES
