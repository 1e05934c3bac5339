"""Which tool-call format a chat template teaches its model, told by the markers it writes.

`detect_format(chat_template)` looks for the markers each format's template writes:

| format        | models (templates)                            | marker                              |
| ------------- | --------------------------------------------- | ----------------------------------- |
| `harmony`     | gpt-oss                                       | `<|channel|>` with `<|call|>`       |
| `deepseek`    | DeepSeek V3, R1 (and distills), V3.1          | `<｜tool▁calls▁begin｜>`            |
| `deepseek_v3_2`, `deepseek_v4` | DeepSeek V3.2, V4            | `｜DSML｜` with `function_calls` / `tool_calls` |
| `mistral`     | Mistral Nemo, Small 3.x, Devstral, Ministral  | `[TOOL_CALLS]`                      |
| `granite_3`   | Granite 3.x                                   | `<|tool_call|>`                     |
| `kimi_k2`     | Kimi K2                                       | `<|tool_calls_section_begin|>`      |
| `minimax_m2`  | MiniMax M2                                    | `<minimax:tool_call>`               |
| `seed_oss`    | Seed-OSS                                      | `<seed:tool_call>`                  |
| `functionary_v3_1` | Functionary v3.1                         | `<function=` with `<|python_tag|>`  |
| `qwen3_xml`   | Qwen3-Coder, Qwen3.5, Nemotron 3, Step 3.5    | `<tool_call>` with `<function=`     |
| `glm`         | GLM 4.5+, Ling, Laguna, Spark                 | `<tool_call>` with `<arg_key>`      |
| `tool_calls_json` | Apriel, MiniMax-M1                        | `<tool_calls>`                      |
| `nemotron_json` | Nemotron Nano 2                             | `<TOOLCALL>`                        |
| `cohere`      | Command R7B, Command A                         | `<|START_ACTION|>`                  |
| `lfm2`        | LFM2, LFM2.5                                  | `<|tool_call_start|>` or `<|tool_list_start|>` |
| `gemma4`      | Gemma 4                                       | `<|tool_call>`                      |
| `minicpm5`    | MiniCPM 5                                     | `<function name="`                  |
| `hunyuan_3`   | Hunyuan 3                                     | `HYTK` (its `:opensource` tags)     |
| `apertus`     | Apertus                                       | `<|tools_prefix|>`                  |
| `hermes`      | Hermes, Qwen 2.5/3, Granite 4, ...            | `<tool_call>`                       |
| `llama3_json` | Llama 3.1-3.3                                 | `<|python_tag|>`, or ipython with parameters |

Templates with another known call syntax (`UNSUPPORTED`) get that family's name, and a request
with tools for such a model is refused with a clear error (`check_supported`, a ToolCallError);
a template with no tool markers at all is taken as `hermes`, the common default. The parser for
each supported format is `parsers.make_parser`'s. Where the model's tokenizer holds a format's
markers as special tokens, the answer is decoded with its special tokens (`needs_special_tokens`).
"""

from __future__ import annotations

from baselm.tokenizer.tokenizer import Tokenizer
from baselm.toolcalls import formats
from baselm.toolcalls.blocks import BLOCK_FORMATS, block_markers
from baselm.toolcalls.errors import ToolCallError
from baselm.toolcalls.parsers import HERMES, HERMES_CLOSE, HERMES_OPEN, LLAMA3_JSON, PYTHON_TAG

HARMONY, DEEPSEEK, MISTRAL, QWEN3_XML, GLM = "harmony", "deepseek", "mistral", "qwen3_xml", "glm"
# The markers each format writes (Llama 3's tag is read whether it is kept or not).
MARKERS = {
    HERMES: (HERMES_OPEN, HERMES_CLOSE),
    LLAMA3_JSON: (),
    **formats.MARKERS,
    **{fmt: block_markers(fmt) for fmt in BLOCK_FORMATS},
}

# Checked in order: the first format all of whose markers the template holds.
_SUPPORTED_MARKERS: list[tuple[str, tuple[str, ...]]] = [
    (HARMONY, ("<|channel|>", "<|call|>")),
    ("deepseek_v3_2", ("｜DSML｜", "'function_calls")),
    ("deepseek_v4", ("｜DSML｜", "'tool_calls")),
    (DEEPSEEK, ("<｜tool▁calls▁begin｜>",)),
    (MISTRAL, ("[TOOL_CALLS]",)),
    ("granite_3", ("<|tool_call|>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("seed_oss", ("<seed:tool_call>",)),
    ("functionary_v3_1", ("<function=", PYTHON_TAG)),
    (QWEN3_XML, ("<tool_call>", "<function=")),
    (GLM, ("<tool_call>", "<arg_key>")),
    ("tool_calls_json", ("<tool_calls>",)),
    ("nemotron_json", ("<TOOLCALL>",)),
    ("cohere", ("<|START_ACTION|>",)),
    ("lfm2", ("<|tool_call_start|>",)),
    ("lfm2", ("<|tool_list_start|>",)),
    ("gemma4", ("<|tool_call>",)),
    ("minicpm5", ('<function name="',)),
    ("hunyuan_3", ("HYTK", "tool_calls")),
    ("apertus", ("<|tools_prefix|>",)),
]
# Call syntaxes base does not read yet, by the family that writes them.
UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "cohere_command_r": ("<|START_OF_TURN_TOKEN|>", "Action:"),
    "functionary_v3_2": (">>>all",),
    "firefunction_v2": ("functools",),
    "gigachat_3": ("<|role_sep|>", "'function call'"),
    "gigachat_3_1": ("<|function_call|>",),
    "kimi_k3": ("open_tag('call'",),
    "minimax_m3": ("]<]minimax[>[",),
    "muse": ("<atem:function_calls>",),
    "solar_open": ("<|tool_call:begin|>",),
}


def detect_format(chat_template: str | dict[str, str] | None) -> str:
    """The call format `chat_template` teaches: a format `parsers.make_parser` reads, or a name in `UNSUPPORTED`."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    for fmt, markers in _SUPPORTED_MARKERS:
        if all(m in text for m in markers):
            return fmt
    for family, markers in UNSUPPORTED.items():
        if all(m in text for m in markers):
            return family
    if HERMES_OPEN in text:
        return HERMES
    if PYTHON_TAG in text or ("ipython" in text and "parameters" in text):
        return LLAMA3_JSON
    return HERMES


def check_supported(fmt: str) -> None:
    """Raises ToolCallError when requests with tools cannot be served for this format. Every format
    base reads can also be forced (forcing.py, forced_formats.py)."""
    if fmt in UNSUPPORTED:
        marker = " ... ".join(UNSUPPORTED[fmt])
        raise ToolCallError(
            f"this model's chat template writes tool calls in the {fmt} format ({marker}), which base "
            "does not parse yet; send the request without tools or with tool_choice 'none'",
            "tools",
        )


def needs_special_tokens(fmt: str, tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` holds a marker of `fmt` as a special token: then the answer must be
    decoded with its special tokens for the calls to be read."""
    special = tokenizer.special_token_ids
    return any(tokenizer.token_to_id(marker) in special for marker in MARKERS.get(fmt, ()))
